//! `dflow plan`, driven through the real binary.

mod support;
use support::{dflow, scratch, stdout};

#[test]
fn plan_picks_data_parallelism_for_the_digits_mlp_and_writes_a_timeline() {
    let dir = scratch("plan_timeline");
    let trace = dir.join("step.json");
    let args = [
        "plan",
        "examples/digits/digits.json",
        "--devices",
        "2",
        "--timeline",
        trace.to_str().unwrap(),
    ];
    let out = stdout(&dflow(&args));
    assert!(
        out.contains("pick: dp2 tp1 pp1 (dp=2,tp=1,pp=1,zero=0,m=1,schedule=1f1b)"),
        "{out}"
    );
    assert!(out.contains("layouts fit"), "{out}");
    // Deterministic: the same command prints the same bytes.
    assert_eq!(stdout(&dflow(&args)), out);
    let text = std::fs::read_to_string(&trace).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(json["traceEvents"].as_array().unwrap().len() >= 3);
}

#[test]
fn plan_shows_a_pipeline_layout_in_detail() {
    let out = stdout(&dflow(&[
        "plan",
        "examples/gpt/gpt.json",
        "--devices",
        "2",
        "--batch-size",
        "12",
        "--layout",
        "pp=2,m=4",
    ]));
    assert!(out.contains("layout dp1 tp1 pp2 m4"), "{out}");
    assert!(out.contains("stage 1: "), "{out}");
    assert!(out.contains("bubble"), "{out}");
}

#[test]
fn plan_lays_out_the_experts_of_the_moe_gpt() {
    let out = stdout(&dflow(&[
        "plan",
        "examples/gpt/gpt-moe.json",
        "--devices",
        "4",
        "--batch-size",
        "8",
        "--layout",
        "dp=4,ep=2",
    ]));
    // Both expert-parallel sizes the 4 experts split over are ranked beside the dense layouts.
    for l in ["dp4 tp1 pp1 ep2 ", "dp4 tp1 pp1 ep4 ", "dp4 tp1 pp1 "] {
        assert!(out.lines().any(|x| x.contains(l)), "no {l} in {out}");
    }
    assert!(
        out.contains("layout dp4 tp1 pp1 ep2 (dp=4,tp=1,pp=1,ep=2"),
        "{out}"
    );
    assert!(out.contains("expert all-to-alls"), "{out}");
    // The job plan's own count: 4 workers under --strategy expert.
    assert!(
        out.contains("as dflow runs it (--strategy expert;"),
        "{out}"
    );
    assert_eq!(out.matches("collective calls").count(), 4, "{out}");
    // Beside tensor parallelism (dp × tp × ep): the MoE MLPs replicated over tp, the job
    // plan's count that of --strategy tensor with ep.
    let out = stdout(&dflow(&[
        "plan",
        "examples/gpt/gpt-moe.json",
        "--devices",
        "4",
        "--batch-size",
        "8",
        "--layout",
        "dp=2,tp=2,ep=2",
    ]));
    assert!(out.lines().any(|x| x.contains("dp2 tp2 pp1 ep2 ")), "{out}");
    assert!(
        out.contains("layout dp2 tp2 pp1 ep2 (dp=2,tp=2,pp=1,ep=2"),
        "{out}"
    );
    assert!(out.contains("expert all-to-alls"), "{out}");
    assert!(
        out.contains("as dflow runs it (--strategy tensor;"),
        "{out}"
    );
    assert_eq!(out.matches("collective calls").count(), 4, "{out}");
    // ZeRO-3 beside ep × tp is ranked and shown (the weights sharded over data_t<t> and the
    // experts' holders, gathered before each pass).
    let out = stdout(&dflow(&[
        "plan",
        "examples/gpt/gpt-moe.json",
        "--devices",
        "4",
        "--batch-size",
        "8",
        "--layout",
        "dp=2,tp=2,ep=2,zero=3",
    ]));
    assert!(
        out.lines().any(|x| x.contains("dp2 tp2 pp1 ep2 z3 ")),
        "{out}"
    );
    assert!(out.contains("layout dp2 tp2 pp1 ep2 z3 ("), "{out}");
    assert!(
        out.contains("as dflow runs it (--strategy tensor;"),
        "{out}"
    );
}

#[test]
fn plan_refuses_bad_input_naming_it() {
    for (args, want) in [
        (
            vec!["--preset", "tpu"],
            "unknown preset `tpu`; the presets are: this-machine, a100-80g-8x, h100-80g-8x",
        ),
        (
            vec!["--layout", "dp=4"],
            "mesh dp=4,tp=1,pp=1 has 4 ranks but the job has 2 tasks",
        ),
        (vec!["--layout", "dp=2,x=2"], "unknown key `x`"),
        // The digits MLP has no MoE layer to spread over an ep axis.
        (
            vec!["--layout", "dp=2,ep=2"],
            "ep=2 spreads the experts of MoE layers, and the model has none",
        ),
        (vec!["--batch-size", "0"], "--batch-size must be at least 1"),
    ] {
        let mut all = vec!["plan", "examples/digits/digits.json", "--devices", "2"];
        all.extend(args);
        let out = dflow(&all);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{all:?}: {err}");
    }
}

#[test]
fn a_calibrated_profile_feeds_the_planner() {
    let dir = scratch("plan_calibrate");
    let profile = dir.join("this-box.json");
    // Small and few measurements: this checks the path, not the machine's speed.
    stdout(&dflow(&[
        "bench",
        "calibrate",
        "--name",
        "this-box",
        "--iters",
        "2",
        "--large-bytes",
        "65536",
        "--job-runs",
        "1",
        "--job-epochs",
        "2",
        "--out",
        profile.to_str().unwrap(),
    ]));
    let text = std::fs::read_to_string(&profile).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    for field in ["flops_per_second", "memory_per_device"] {
        assert!(json[field].as_f64().unwrap() > 0.0, "{field}: {text}");
    }
    for link in ["intra_host", "inter_host"] {
        assert!(
            json[link]["bandwidth"].as_f64().unwrap() > 0.0,
            "{link}: {text}"
        );
        assert!(
            json[link]["latency"].as_f64().unwrap() >= 0.0,
            "{link}: {text}"
        );
    }
    assert!(
        json["source"]
            .as_str()
            .unwrap()
            .contains("dflow bench calibrate"),
        "{text}"
    );
    // The synthetic jobs ran and their costs were fitted: none negative, and a step of a
    // 2-worker job costs something.
    for cost in ["step", "task", "op", "collective"] {
        assert!(json["job"][cost].as_f64().unwrap() >= 0.0, "{cost}: {text}");
    }
    let job = &json["job"];
    assert!(
        job["step"].as_f64().unwrap() + 2.0 * job["task"].as_f64().unwrap() > 0.0,
        "{text}"
    );
    let source = json["source"].as_str().unwrap();
    for what in ["synthetic calibration jobs", "non-negative least squares"] {
        assert!(source.contains(what), "{what}: {text}");
    }
    let out = stdout(&dflow(&[
        "plan",
        "examples/digits/digits.json",
        "--devices",
        "2",
        "--profile",
        profile.to_str().unwrap(),
    ]));
    assert!(out.contains("this-box"), "{out}");
    assert!(out.contains("pick: "), "{out}");
}

#[test]
fn calibrate_refuses_impossible_measurements_naming_the_flag() {
    for (args, want) in [
        (vec!["--ranks", "1"], "--ranks must be at least 2"),
        (
            vec!["--large-bytes", "4"],
            "--large-bytes must be at least 4 bytes per rank",
        ),
    ] {
        let mut all = vec!["bench", "calibrate"];
        all.extend(args);
        let out = dflow(&all);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{err}");
    }
}

/// Every layout `dflow plan` ranks (fitting or not) is one `dflow run` runs: the planner's
/// enumeration never offers a layout whose job plan the strategies refuse. The bundled GPT on 4
/// and 8 devices (dp, tp, pp, ZeRO 0–3, micro-batches, their 3D combinations) and the MoE GPT
/// on 4 (ep beside dp, inside pipeline stages and beside tp, ZeRO 0–3 each) and 8 (the 4-axis
/// mesh dp × tp × pp × ep too, ZeRO 0–3); an MoE GPT no router couples on 8 (ep × pp with 2
/// micro-batches and dp > ep, ZeRO-3 too); a GPT whose vocabulary (33) tp = 2 does not divide
/// on 4 (the tensor strategy pads it).
#[test]
fn every_layout_the_planner_ranks_builds_the_job_plan_dflow_runs() {
    use dflow::partitioner::planner::{
        self, accounting, ClusterProfile, ModelProfile, PlanOptions,
    };
    let profile = ClusterProfile::preset("this-machine").unwrap();
    for (graph, devices, batch) in [
        ("examples/gpt/gpt.json", 4, 8),
        ("examples/gpt/gpt.json", 8, 16),
        ("examples/gpt/gpt-moe.json", 4, 8),
        ("examples/gpt/gpt-moe.json", 8, 8),
        (UNCOUPLED_MOE, 8, 8),
        (ODD_VOCABULARY, 4, 8),
    ] {
        let def = plan_graph(graph);
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        let options = PlanOptions {
            devices,
            batch_size: batch,
        };
        let report = planner::plan(&model, &profile, &options).unwrap();
        let g = dflow::graph::Graph::from_def(&def).unwrap();
        let train = def.train.as_ref().unwrap();
        let offered: Vec<_> = report.ranked.iter().chain(&report.too_big).collect();
        assert!(offered.len() >= 8, "{graph} on {devices}: {offered:?}");
        // On 8 devices the MoE GPT's job plans of the 4-axis layouts only (the others are
        // the 4-device ones' kinds; each job plan takes a while in a debug build); of the
        // uncoupled MoE GPT those of ep × pp with several micro-batches and dp > ep.
        let four_axis = |e: &&&planner::Evaluation| {
            let (m, l) = (e.layout.mesh, e.layout);
            if graph == UNCOUPLED_MOE {
                return m.ep > 1 && m.pp > 1 && m.dp > m.ep && l.micro_batches > 1;
            }
            !(graph.ends_with("moe.json") && devices == 8) || (m.tp > 1 && m.pp > 1 && m.ep > 1)
        };
        for e in offered.iter().filter(four_axis) {
            let plan = match accounting::job_plan(&g, train, "idx", "targets", &e.layout, batch) {
                Ok(plan) => plan,
                Err(err) => panic!(
                    "{graph} on {devices} devices: the planner ranks {} but dflow runs no job plan for it: {err}",
                    e.layout.short()
                ),
            };
            // An expert-parallel layout's table row sends what its job plan sends, every
            // collective (the MoE layers' load-balancing losses' all-gathers, dropped-token
            // count and clipping norms too) and every value between stages, every task summed.
            if e.layout.mesh.ep > 1 {
                let sent = accounting::traffic(&plan, batch / e.layout.mesh.dp).unwrap();
                let bytes = |c: planner::collective::CommCost| c.intra_bytes + c.inter_bytes;
                let t = e.traffic;
                let collective = sent.iter().map(|t| t.collective).sum::<u64>();
                let data_plane = sent.iter().map(|t| t.data_plane).sum::<u64>();
                assert_eq!(
                    bytes(t.tensor_parallel) + bytes(t.data_parallel) + bytes(t.expert_parallel),
                    collective as f64,
                    "{graph} on {devices} devices, {}: the table's collective bytes",
                    e.layout.short()
                );
                assert_eq!(
                    bytes(t.pipeline),
                    data_plane as f64,
                    "{graph} on {devices} devices, {}: the table's bytes between stages",
                    e.layout.short()
                );
            }
        }
        let kinds = |f: fn(&planner::Layout) -> bool| offered.iter().any(|e| f(&e.layout));
        let kinds_at = |zero: u8, f: fn(&planner::Layout) -> bool| {
            offered
                .iter()
                .any(|e| e.layout.zero == zero && f(&e.layout))
        };
        assert!(kinds(|l| l.zero == 3), "{graph}");
        if graph == UNCOUPLED_MOE {
            // ZeRO-3 beside ep × pp with 2 micro-batches and expert-data-parallel groups
            // (`dp=4,ep=2,pp=2,m=2,zero=3`, built above).
            assert!(
                kinds(|l| l.mesh.ep > 1
                    && l.mesh.pp > 1
                    && l.mesh.dp > l.mesh.ep
                    && l.micro_batches > 1
                    && l.zero == 3),
                "{graph}"
            );
        } else if graph == ODD_VOCABULARY {
            // A vocabulary of 33 at tp = 2 (padded to 34, as dflow runs it; the preset's
            // hosts have 2 devices, so no tp = 4), beside dp and inside pipeline stages.
            assert!(kinds(|l| l.mesh.tp == 2 && l.mesh.dp == 2), "{graph}");
            assert!(kinds(|l| l.mesh.tp == 2 && l.mesh.pp == 2), "{graph}");
        } else if graph.ends_with("moe.json") {
            assert!(kinds(|l| l.mesh.ep > 1 && l.mesh.pp > 1), "{graph}");
            // ZeRO: up to 3 beside ep × pp and beside ep × tp (each built above).
            assert!(
                kinds(|l| l.mesh.ep > 1 && l.mesh.pp > 1 && l.zero == 3),
                "{graph}"
            );
            assert!(
                kinds(|l| l.mesh.ep > 1 && l.mesh.tp > 1 && l.zero == 2),
                "{graph}"
            );
            assert!(
                kinds(|l| l.mesh.ep > 1 && l.mesh.tp > 1 && l.zero == 3),
                "{graph}"
            );
            // Tensor parallelism splits dense MLPs only (beside it the MoE MLPs are
            // replicated over tp with their experts over ep), and the MoE layers couple a
            // batch's examples: tp only beside ep (dp × tp × ep), no micro-batches.
            assert!(kinds(|l| l.mesh.tp > 1 && l.mesh.ep > 1), "{graph}");
            if devices == 8 {
                // The 4-axis mesh dp × tp × pp × ep, ZeRO 0 to 3 (each built above).
                for zero in 0..=3 {
                    assert!(
                        kinds_at(zero, |l| l.mesh.tp > 1 && l.mesh.pp > 1 && l.mesh.ep > 1),
                        "{graph} on 8: no dp × tp × pp × ep layout at ZeRO-{zero}"
                    );
                }
            }
            assert!(
                !kinds(|l| (l.mesh.tp > 1 && l.mesh.ep == 1) || l.micro_batches > 1),
                "{graph}"
            );
        } else {
            assert!(kinds(|l| l.mesh.tp > 1 && l.mesh.pp > 1), "{graph}");
        }
    }
}

/// A GPT of two MoE blocks (4 experts) that no router couples (capacity factor 4, α = 0), so
/// its `ep × pp` layouts take micro-batches; built by [`plan_graph`].
const UNCOUPLED_MOE: &str = "uncoupled MoE GPT";

/// A small GPT whose vocabulary (33) no tp > 1 divides: the tensor strategy pads it.
const ODD_VOCABULARY: &str = "GPT with a vocabulary of 33";

/// The graph `name` names: a file of the repository, or one of the GPTs built here.
fn plan_graph(name: &str) -> dflow::graph::GraphDef {
    use dflow::graph::layers::{gpt, GptConfig, MoeConfig};
    let small = GptConfig {
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        ..GptConfig::default()
    };
    match name {
        UNCOUPLED_MOE => {
            gpt(&GptConfig {
                vocab_size: 32,
                moe: Some(MoeConfig {
                    num_experts: 4,
                    top_k: 1,
                    capacity_factor: 4.0,
                    aux_loss_coef: 0.0,
                }),
                ..small
            })
            .unwrap()
            .def
        }
        ODD_VOCABULARY => {
            gpt(&GptConfig {
                vocab_size: 33,
                n_head: 4,
                ..small
            })
            .unwrap()
            .def
        }
        file => {
            let text = std::fs::read_to_string(support::repo().join(file)).unwrap();
            dflow::graph::format::parse_json(&text, None).unwrap().def
        }
    }
}
