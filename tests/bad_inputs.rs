//! The bad-input catalog (`tests/bad_inputs/`): every file must fail to load with a clear,
//! positioned message. The messages are snapshots (`tests/snapshots/`), reviewed by hand.

use dflow::load::{load_graph, LoadError};
use std::path::{Path, PathBuf};

/// Every file of the catalog, sorted, as paths relative to this crate (stable in snapshots).
fn catalog() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bad_inputs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "README.md")
        .map(|n| Path::new("bad_inputs").join(n))
        .collect();
    files.sort();
    files
}

#[test]
fn catalog_is_big_enough() {
    let files = catalog();
    assert!(files.len() >= 30, "only {} bad inputs", files.len());
    let json = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "json"))
        .count();
    let dsl = files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "dflow"))
        .count();
    assert!(json >= 15 && dsl >= 15, "{json} JSON and {dsl} DSL files");
}

#[test]
fn every_bad_input_fails_with_a_positioned_message() {
    // Paths in messages are relative to this crate's directory, the test's working directory.
    for path in catalog() {
        let shown = path.display().to_string();
        let err = match load_graph(&path) {
            Ok(_) => panic!("{shown}: loaded, but it is a bad input"),
            Err(e) => e,
        };
        let text = err.to_string();
        assert!(err.count() >= 1, "{shown}");
        // Every entry names the file; errors about a place in the file name line and column.
        assert!(text.starts_with(&format!("{shown}:")), "{shown}: {text}");
        if let LoadError::Invalid { rendered, .. } = &err {
            for r in rendered {
                assert!(r.starts_with(&format!("{shown}:")), "{r}");
            }
        }
        let name = path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace('.', "_");
        insta::assert_snapshot!(name, text);
    }
}

#[test]
fn a_missing_file_is_an_error_naming_it() {
    let err = load_graph(Path::new("bad_inputs/does_not_exist.json")).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("bad_inputs/does_not_exist.json: cannot read:"),
        "{text}"
    );
}
