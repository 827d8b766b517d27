//! Messages that say what is wrong and what to do: a training graph run without `--data`,
//! TensorFlow GraphDefs in `check` and `convert`, `partition --help`, a 70,000-character
//! device (once a panic), plain-text logs in files, and a task whose cluster secret is missing
//! or different (clear on both sides, not "joined" then "Broken pipe" or "early eof").

mod support;
use std::time::Duration;
use support::*;

const TF_GRAPHDEF: &str = "tests/fixtures/tf/ps_mlp.graphdef.json";

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_training_graph_without_data_is_told_to_give_data() {
    let out = dflow(&["run", "--local", "examples/digits/digits.json"]);
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    assert!(
        e.contains("is a training graph") && e.contains("--data FILE") && e.contains("loss"),
        "{e}"
    );
    // A graph without a `train` section is told about --fetch and --target.
    let out = dflow(&["run", "--local", "examples/mlp/mlp.json"]);
    let e = stderr(&out);
    assert!(
        e.contains("--fetch NAME") && e.contains("--target NAME"),
        "{e}"
    );
}

#[test]
fn check_and_convert_read_tensorflow_graphdefs() {
    let out = dflow(&["check", TF_GRAPHDEF]);
    let text = stdout(&out);
    assert!(
        text.contains("format:       tensorflow graphdef (imported)"),
        "{text}"
    );
    assert!(text.contains("MatMul"), "{text}");
    let out = dflow(&["convert", TF_GRAPHDEF, "--to", "dsl"]);
    let dsl = stdout(&out);
    let parsed = dflow::graph::format::parse_dsl(&dsl, None).expect("convert wrote valid DSL");
    assert!(parsed.def.nodes.iter().any(|n| n.op == "MatMul"));
    // An import error names the file and the problem.
    let dir = scratch("cli_messages_graphdef");
    let bad = dir.join("bad.graphdef.json");
    std::fs::write(&bad, r#"{"node": [{"name": "x", "op": "NoSuchOp"}]}"#).unwrap();
    let out = dflow(&["check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    assert!(
        e.contains("bad.graphdef.json") && e.contains("NoSuchOp (x)"),
        "{e}"
    );
}

#[test]
fn partition_help_names_every_input_format() {
    let out = dflow(&["partition", "--help"]);
    let help = stdout(&out);
    assert!(help.contains("TensorFlow GraphDef"), "{help}");
    assert!(!help.contains("(dflow graph JSON)"), "{help}");
}

#[test]
fn a_device_of_70000_characters_is_an_error_not_a_panic() {
    let dir = scratch("cli_messages_long_device");
    let path = dir.join("long.json");
    let device = format!("/job:{}", "w".repeat(70_000));
    std::fs::write(
        &path,
        format!(
            r#"{{"format": "dflow-graph", "version": 1, "nodes": [{{"name": "x", "op": "Placeholder",
            "device": "{device}", "attrs": {{"dtype": "f32", "shape": [-1, 4]}}}}]}}"#
        ),
    )
    .unwrap();
    let out = dflow(&["check", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let e = stderr(&out);
    assert!(e.contains("70005 bytes long") && e.len() < 2_000, "{e}");
}

fn no_ansi(what: &str, text: &str) {
    assert!(
        !text.contains('\u{1b}'),
        "{what} holds ANSI escape codes:\n{text}"
    );
}

#[test]
fn a_task_without_the_secret_is_told_so_on_both_sides() {
    let _serial = serial();
    let cluster = Cluster::new(1, 1);
    let secret_file = cluster.path("secret");
    std::fs::write(&secret_file, "a-cluster-secret-of-32-bytes-xyz").unwrap();
    let sf = secret_file.to_string_lossy().into_owned();
    let ps = Task::start(&cluster, "ps", 0, &["--secret-file", &sf]);
    let mut args = vec!["examples/digits/digits.json"];
    let digits = digits_args(1);
    args.extend(digits.iter().map(String::as_str));
    let chief = Task::start(&cluster, "worker", 0, &args).wait(Duration::from_secs(60));
    chief.assert_failure_naming("requires the job's cluster secret and this task sent none");
    assert!(chief.stderr.contains("--secret-file"), "{}", chief.stderr);
    assert!(!chief.stderr.contains("Broken pipe"), "{}", chief.stderr);
    ps.wait_for_stderr(Duration::from_secs(30), |s| {
        s.contains("connected without authenticating, but this job requires the cluster secret")
    });
    no_ansi("the ps's log file", &ps.stderr());
    no_ansi("the chief's log file", &chief.stderr);
    ps.kill();
}

#[test]
fn a_task_with_a_different_secret_is_told_so_on_both_sides() {
    let _serial = serial();
    let cluster = Cluster::new(1, 1);
    let (good, wrong) = (cluster.path("good"), cluster.path("wrong"));
    std::fs::write(&good, "a-cluster-secret-of-32-bytes-xyz").unwrap();
    std::fs::write(&wrong, "another-secret-of-32-bytes-abcde").unwrap();
    let (good, wrong) = (
        good.to_string_lossy().into_owned(),
        wrong.to_string_lossy().into_owned(),
    );
    let ps = Task::start(
        &cluster,
        "ps",
        0,
        &["--secret-file", &good, "--startup-timeout", "4"],
    );
    let mut args = vec![
        "examples/digits/digits.json",
        "--secret-file",
        &wrong,
        "--startup-timeout",
        "4",
    ];
    let digits = digits_args(1);
    args.extend(digits.iter().map(String::as_str));
    let chief = Task::start(&cluster, "worker", 0, &args).wait(Duration::from_secs(60));
    chief.assert_failure_naming("its cluster secret differs from this task's");
    let ps = ps.wait(Duration::from_secs(60));
    assert!(
        ps.stderr
            .contains("its cluster secret differs from this task's"),
        "{}",
        ps.stderr
    );
    assert!(!ps.stderr.contains("early eof"), "{}", ps.stderr);
    // The retries every 0.5 s are not each logged as an error.
    let refusals = ps
        .stderr
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("authenticating"))
        .count();
    assert!(refusals <= 2, "{refusals} refusals logged:\n{}", ps.stderr);
}
