//! The README's "Use dflow as a library" section shows `tests/library_snapshot.rs` verbatim, so
//! the code a user copies is the code CI runs.

#[test]
fn the_readme_shows_the_library_snapshot_test_verbatim() {
    let readme = include_str!("../../README.md");
    let test = include_str!("library_snapshot.rs");
    let block = format!("```rust\n{test}```");
    assert!(
        readme.contains(&block),
        "README.md's library section differs from examples/tests/library_snapshot.rs: copy the file into the ```rust block"
    );
}
