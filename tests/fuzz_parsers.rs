//! No panic on any input: property tests that mutate a committed seed corpus
//! (`tests/fuzz_corpus/{json,dsl,graphdef,wire}`) and feed the result to every parser that reads
//! user or peer bytes: the JSON and DSL graph formats (then validation and `dflow check`'s
//! summary), the TensorFlow GraphDef importer, the wire-frame header decoder and the
//! authentication handshake, and a live TCP endpoint. A panic fails the test; proptest shrinks
//! the mutation list to a minimal one and prints it (the runs are deterministic per seed; add a
//! failing input to the corpus as a regression seed).
//!
//! The number of cases per target is `DFLOW_FUZZ_CASES` (default 256, a few seconds each in a
//! debug build). For a longer run:
//! `DFLOW_FUZZ_CASES=200000 cargo test --release -p dflow-tests --test fuzz_parsers`.

use dflow_graph::format::{parse_dsl, parse_json};
use dflow_graph::tf_import::import_graphdef_json;
use dflow_graph::Graph;
use dflow_transport::auth::{Acceptor, Connector, Secret};
use dflow_transport::wire::{decode_header_slice, HEADER_LEN};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

/// Cases per target: `DFLOW_FUZZ_CASES`, else 256.
fn cases() -> u32 {
    std::env::var("DFLOW_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// The seed files of one target, in name order.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz_corpus")
        .join(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    paths.sort();
    let files: Vec<Vec<u8>> = paths.iter().filter_map(|p| std::fs::read(p).ok()).collect();
    assert!(!files.is_empty(), "{}: no seeds", dir.display());
    files
}

/// Byte strings worth splicing in: structure, extreme numbers, escapes, a device string past
/// `format!`'s width limit, deep nesting.
fn tokens() -> Vec<Vec<u8>> {
    let mut t: Vec<Vec<u8>> = [
        "{",
        "}",
        "[",
        "]",
        "\"",
        ",",
        ":",
        "\\u0000",
        "\\ud800",
        "-1",
        "0",
        "1e309",
        "-0",
        "18446744073709551616",
        "NaN",
        "null",
        "true",
        "/job:",
        "/task:99999999999",
        "^",
        ":1",
        "@",
        "=",
        "(",
        ")",
        "\n",
        "\u{feff}",
        "\u{1F600}",
        "DT_FLOAT",
        "DT_STRING",
        "tensorContent",
        "floatVal",
        "\"size\": \"-5\"",
        "\"size\": \"4294967296\"",
        "Const",
        "Variable",
        "AddN",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    t.push("x".repeat(70_000).into_bytes());
    t.push("[".repeat(5_000).into_bytes());
    t.push("{\"a\":".repeat(2_000).into_bytes());
    t
}

/// One edit of a seed.
#[derive(Debug, Clone)]
enum Edit {
    /// Overwrite a byte (position taken modulo the length).
    Set(usize, u8),
    /// Insert token number `.1` (modulo the token count) at a position.
    Insert(usize, usize),
    /// Remove up to `.1` bytes at a position.
    Remove(usize, usize),
    /// Copy up to `.2` bytes from `.0` to `.1`.
    Copy(usize, usize, usize),
    /// Cut the input at a position.
    Truncate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Edit::Set(p, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(p, t)| Edit::Insert(p, t)),
        (any::<usize>(), 1usize..64).prop_map(|(p, n)| Edit::Remove(p, n)),
        (any::<usize>(), any::<usize>(), 1usize..256).prop_map(|(a, b, n)| Edit::Copy(a, b, n)),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

/// A seed index and the edits to apply to it.
fn mutation() -> impl Strategy<Value = (usize, Vec<Edit>)> {
    (any::<usize>(), prop::collection::vec(edit(), 0..6))
}

fn apply(seeds: &[Vec<u8>], tokens: &[Vec<u8>], (seed, edits): &(usize, Vec<Edit>)) -> Vec<u8> {
    let mut b = seeds[seed % seeds.len()].clone();
    for e in edits {
        let at = |p: usize, len: usize| if len == 0 { 0 } else { p % (len + 1) };
        match *e {
            Edit::Set(p, v) if !b.is_empty() => {
                let i = p % b.len();
                b[i] = v;
            }
            Edit::Set(..) => {}
            Edit::Insert(p, t) => {
                let i = at(p, b.len());
                let tok = &tokens[t % tokens.len()];
                b.splice(i..i, tok.iter().copied());
            }
            Edit::Remove(p, n) => {
                let i = at(p, b.len());
                let end = (i + n).min(b.len());
                b.drain(i..end);
            }
            Edit::Copy(from, to, n) => {
                let i = at(from, b.len());
                let chunk: Vec<u8> = b[i..(i + n).min(b.len())].to_vec();
                let j = at(to, b.len());
                b.splice(j..j, chunk);
            }
            Edit::Truncate(p) => {
                let i = at(p, b.len());
                b.truncate(i);
            }
        }
    }
    b
}

/// What `dflow check` does with a parsed graph: validate, then print the summary.
fn check_like(def: &dflow_graph::GraphDef) {
    if let Ok(g) = Graph::from_def(def) {
        let _ = dflow::load::Summary::of(&g).to_string();
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn json_parser_never_panics(m in mutation()) {
        thread_local!(static SEEDS: (Vec<Vec<u8>>, Vec<Vec<u8>>) = (corpus("json"), tokens()));
        let bytes = SEEDS.with(|(s, t)| apply(s, t, &m));
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(parsed) = parse_json(&text, Some("fuzz.json")) {
            check_like(&parsed.def);
        }
    }

    #[test]
    fn dsl_parser_never_panics(m in mutation()) {
        thread_local!(static SEEDS: (Vec<Vec<u8>>, Vec<Vec<u8>>) = (corpus("dsl"), tokens()));
        let bytes = SEEDS.with(|(s, t)| apply(s, t, &m));
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(parsed) = parse_dsl(&text, Some("fuzz.dflow")) {
            check_like(&parsed.def);
        }
    }

    #[test]
    fn graphdef_import_never_panics(m in mutation()) {
        thread_local!(static SEEDS: (Vec<Vec<u8>>, Vec<Vec<u8>>) = (corpus("graphdef"), tokens()));
        let bytes = SEEDS.with(|(s, t)| apply(s, t, &m));
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(def) = import_graphdef_json(&text) {
            check_like(&def);
        }
    }

    #[test]
    fn wire_frames_and_handshake_never_panic(m in mutation()) {
        thread_local!(static SEEDS: (Vec<Vec<u8>>, Vec<Vec<u8>>) = (corpus("wire"), tokens()));
        let bytes = SEEDS.with(|(s, t)| apply(s, t, &m));
        // Walk the bytes as a frame stream, as a reader would.
        let mut at = 0;
        while at + HEADER_LEN <= bytes.len() {
            let Ok(h) = decode_header_slice(&bytes[at..], 1 << 20) else { break };
            at += HEADER_LEN;
            let len = usize::try_from(h.payload_len).unwrap_or(usize::MAX);
            at = at.saturating_add(len);
        }
        // The same bytes as each handshake message.
        let secret = Secret::new(b"fuzz-secret-0123456789abcdef", "fuzz").unwrap();
        if let Ok((acceptor, _challenge)) = Acceptor::challenge(&secret, "ps:0", &bytes, "fuzz") {
            let _ = acceptor.verify(&bytes, "fuzz");
        }
        let (connector, _hello) = Connector::hello(&secret, "worker:0");
        let _ = connector.answer(&bytes, "ps:0");
    }
}

/// Mutated frame streams sent to a live TCP endpoint: the endpoint must neither panic (a panic
/// in its reader task would only be logged, so a hook counts them) nor stop serving.
#[test]
fn tcp_endpoint_survives_mutated_streams() {
    use dflow_transport::tcp::TcpPlane;
    use dflow_transport::TcpConfig;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    static PANICS: AtomicUsize = AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
    let seeds = corpus("wire");
    let hello =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz_corpus/wire/hello.bin"))
            .unwrap();
    let toks = tokens();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        ProptestConfig {
            cases: (cases() / 4).max(16),
            failure_persistence: None,
            ..ProptestConfig::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    rt.block_on(async {
        let config = TcpConfig {
            frame_timeout: Duration::from_millis(200),
            ..TcpConfig::default()
        };
        let ps = TcpPlane::bind("ps:0", "127.0.0.1:0".parse().unwrap(), config)
            .await
            .unwrap();
        let key = Arc::new(dflow_transport::RendezvousKey::new(
            "worker:0", "ps:0", "x:0",
        ));
        ps.register_recv(3, "worker:0", key, dflow_graph::DType::F32, &[2])
            .unwrap();
        let addr = ps.local_addr();
        let handle = tokio::runtime::Handle::current();
        let result = tokio::task::spawn_blocking(move || {
            runner.run(&mutation(), |m| {
                let bytes = apply(&seeds, &toks, &m);
                handle.block_on(async {
                    if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                        let _ =
                            tokio::time::timeout(Duration::from_millis(200), s.write_all(&bytes))
                                .await;
                    }
                });
                Ok(())
            })
        })
        .await
        .unwrap();
        result.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Still serving: a well-formed Hello is accepted and kept open.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&hello).await.unwrap();
        ps.shutdown();
    });
    let _ = std::panic::take_hook();
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        0,
        "the endpoint panicked (see above)"
    );
}
