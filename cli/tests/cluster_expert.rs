//! `--strategy expert`: a 2-worker job of a small GPT whose MLPs are mixtures of 4 experts
//! (each worker holds 2 of every layer's experts; tokens travel by all-to-all) trains like
//! `dflow run --local` on the same global batch, for top-1 and top-2 routing and with the
//! gradient clipped by its global norm (expert gradients of both workers counted), and its final
//! validation loss (evaluated on worker 0 with every worker's experts) is the local one's.
//! Real `dflow` processes on 127.0.0.1.
//!
//! The capacity factor is E = 4, so no expert drops a token, neither in one process (capacity
//! over the global batch's tokens) nor on a worker (capacity over its half): with drops the
//! two would drop different tokens (capacity is per worker; docs/experts.md).

mod support;

use dflow::graph::layers::{gpt, GptConfig, MoeConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(120);

/// A two-block GPT (16 characters of context, 16 channels) with 4-expert MoE MLPs, clipping its
/// gradient by global norm when `grad_clip` says so.
fn tiny_moe_gpt(dir: &Path, top_k: usize, grad_clip: Option<f64>) -> PathBuf {
    tiny_moe_gpt_at(dir, top_k, grad_clip, 4.0)
}

/// [`tiny_moe_gpt`] at capacity factor `capacity_factor`.
fn tiny_moe_gpt_at(
    dir: &Path,
    top_k: usize,
    grad_clip: Option<f64>,
    capacity_factor: f64,
) -> PathBuf {
    let cfg = GptConfig {
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        learning_rate: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        decay_steps: 20,
        grad_clip,
        moe: Some(MoeConfig {
            num_experts: 4,
            top_k,
            capacity_factor,
            ..MoeConfig::default()
        }),
        ..GptConfig::default()
    };
    let model = gpt(&cfg).unwrap();
    let path = dir.join(format!(
        "tiny-moe-top{top_k}-clip{grad_clip:?}-cf{capacity_factor}.json"
    ));
    std::fs::write(&path, dflow::graph::format::to_json(&model.def)).unwrap();
    path
}

fn flags() -> Vec<&'static str> {
    vec![
        "--data",
        "examples/data/shakespeare.txt.gz",
        "--batch-size",
        "8",
        "--steps",
        "5",
        "--eval-batches",
        "2",
        "--quiet",
    ]
}

/// The validation loss line's value.
fn validation(stdout: &str) -> f64 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("validation loss: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no validation loss in:\n{stdout}"))
}

#[test]
fn a_two_worker_expert_job_trains_like_one_process_for_top_1_and_top_2_and_clipped() {
    let _serial = serial();
    let dir = scratch("cluster-expert");
    // A small clipping norm: every step's gradient is clipped.
    for (top_k, clip) in [(1, None), (2, None), (1, Some(0.1))] {
        let graph = tiny_moe_gpt(&dir, top_k, clip);
        let graph_s = graph.to_string_lossy().into_owned();
        // One process.
        let local_losses = dir.join(format!("local-{top_k}-{clip:?}.txt"));
        let mut args = vec!["run", "--local", graph_s.as_str()];
        args.extend(flags());
        let local_s = local_losses.to_string_lossy().into_owned();
        args.extend(["--losses-out", &local_s]);
        let out = dflow(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let local = read_losses(&local_losses);
        let local_val = validation(&stdout(&out));
        // Two workers, two experts each.
        let cluster = Cluster::new(0, 2);
        let losses = cluster.path("job-losses.txt");
        let losses_s = losses.to_string_lossy().into_owned();
        let mut common = flags();
        common.extend(["--strategy", "expert"]);
        let other = Task::start(&cluster, "worker", 1, &common);
        let mut chief_args = vec![graph_s.as_str()];
        chief_args.extend(common.iter().copied());
        chief_args.extend(["--losses-out", &losses_s]);
        let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
        chief.assert_success();
        other.wait(Duration::from_secs(30)).assert_success();
        let job = read_losses(&losses);
        assert_eq!(job.len(), 5);
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!("top-{top_k}, clip {clip:?}: worst relative difference {worst:e}");
        let val = validation(&chief.stdout);
        assert!(
            (val - local_val).abs() <= 1e-3,
            "top-{top_k}: validation {val} vs {local_val}"
        );
    }
}

/// `(task, data-plane bytes, collective bytes, collective messages)` of every `sent` line in
/// `stderr` (`<task>: holds …; sent N B in K values over the data plane, M B in J collective messages`).
fn traffic(stderr: &str) -> Vec<(String, u64, u64, u64)> {
    end_of_task(stderr)
        .into_iter()
        .map(|e| (e.task, e.data_plane, e.collective, e.collective_messages))
        .collect()
}

/// The elements of the graph's variables that every worker replicates (all but the experts').
fn replicated_parameters(graph: &Path) -> u64 {
    let text = std::fs::read_to_string(graph).unwrap();
    let parsed = dflow::graph::format::parse_json(&text, None).unwrap();
    parsed
        .def
        .nodes
        .iter()
        .filter(|n| n.op == "Variable" && !n.name.contains(".experts."))
        .map(|n| match n.attrs.get("shape") {
            Some(dflow::graph::AttrValue::Shape(s)) => s.num_elements().unwrap() as u64,
            other => panic!("variable `{}` has shape {other:?}", n.name),
        })
        .sum()
}

/// The collective bytes each worker's transport counted, exactly, and the all-to-all part
/// isolated. Three runs of the same 2-worker top-1 job (3 steps of 8 × 16 tokens, 64 per
/// worker) differ only in the capacity factor (C = 16, 32, 64 slots per expert). Per step and
/// rank a worker sends, for N = 2:
/// - per all-to-all the other worker's experts' blocks of the static `[E, C, d]` f32 buffer,
///   (N−1)·(E/N)·C·d·4 bytes — every capacity slot travels, filled or not, so this is the tokens
///   sent off-rank at full capacity × d_model × 4 — and 4 all-to-alls per MoE layer (2 forward,
///   2 backward);
/// - the replicated gradients' all-reduce: each rank sends the gradient's size once at N = 2
///   (ring: two halves; recursive doubling: the whole), 4 bytes per replicated parameter;
/// - the loss's all-reduce: one f32;
/// - the dropped-token count's all-reduce: one i64;
/// - per MoE layer the router's all-gathers (its own T·E f32 probabilities and T·k i64 choices)
///   and the probabilities' gradient reduce-scatter (the other worker's T·E f32).
///
/// The capacity changes only the first term, so the difference of two runs is the all-to-all
/// difference alone, and the message counts are equal (one message per peer per all-to-all,
/// whatever its size).
#[test]
fn collective_bytes_per_rank_from_the_counters_are_exact_and_all_to_all_is_the_off_rank_slots() {
    let dir = scratch("expert-traffic");
    let (workers, experts, layers, d, top_k, steps) = (2u64, 4u64, 2u64, 16u64, 1u64, 3u64);
    // 8 sequences of 16 tokens per step, half per worker.
    let tokens = 8 * 16 / workers;
    // Per all-to-all and rank: the other workers' blocks of the [E, C, d] f32 buffer.
    let per_all_to_all = |c: u64| (workers - 1) * (experts / workers) * c * d * 4;
    let mut runs = Vec::new();
    for cf in [1.0f64, 2.0, 4.0] {
        let graph = tiny_moe_gpt_at(&dir, top_k as usize, None, cf);
        let losses = dir.join(format!("losses-cf{cf}.txt"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflow"))
            .args(["run", "--local"])
            .arg(&graph)
            .args([
                "--cluster",
                "examples/gpt/cluster-2workers.json",
                "--strategy",
                "expert",
                "--data",
                "examples/data/shakespeare.txt.gz",
                "--batch-size",
                "8",
                "--steps",
                "3",
                "--eval-batches",
                "1",
                "--quiet",
                "--losses-out",
            ])
            .arg(&losses)
            .current_dir(repo())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        assert_eq!(read_losses(&losses).len() as u64, steps, "{stderr}");
        let mut sent = traffic(&stderr);
        sent.sort();
        assert_eq!(sent.len(), 2, "one line per worker:\n{stderr}");
        let capacity = ((tokens as f64 / experts as f64) * cf)
            .ceil()
            .min(tokens as f64) as u64;
        let all_to_all = steps * layers * 4 * per_all_to_all(capacity);
        let gradients = replicated_parameters(&graph) * 4;
        let router = layers * (tokens * experts * 4 + tokens * top_k * 8 + tokens * experts * 4);
        let others = steps * (gradients + 4 + 8 + router);
        for (task, _, coll, _) in &sent {
            assert_eq!(
                *coll,
                all_to_all + others,
                "{task}, capacity {capacity}: {coll} collective bytes, expected all-to-all \
                 {all_to_all} + gradients, loss, dropped count and router {others}"
            );
            eprintln!(
                "{task}, C = {capacity}: {coll} collective bytes = all-to-all {all_to_all} + \
                 gradients, loss and router {others}"
            );
        }
        runs.push((capacity, sent));
    }
    let (c0, base) = &runs[0];
    for (c, sent) in &runs[1..] {
        for ((task, _, coll, messages), (_, _, coll0, messages0)) in sent.iter().zip(base) {
            assert_eq!(
                coll - coll0,
                steps * layers * 4 * (per_all_to_all(*c) - per_all_to_all(*c0)),
                "{task}: capacity {c} vs {c0}"
            );
            assert_eq!(messages, messages0, "{task}: capacity {c} vs {c0}");
        }
    }
}

/// `dflow run --local GRAPH` of the tiny MoE GPT for `steps` steps (a global batch of 8) on
/// `cluster` under `--strategy expert` (every task in this process), or in one process with no
/// strategy when `cluster` is `None`, checkpointing to (and resuming from) `ckpt`: its losses.
fn moe_run(graph: &Path, cluster: Option<&str>, steps: u32, ckpt: &Path) -> Vec<(u64, f64)> {
    let extra = match cluster {
        Some(c) => vec!["--cluster", c, "--strategy", "expert"],
        None => Vec::new(),
    };
    run_text_local(graph, &extra, steps, ckpt).0
}

/// A checkpoint of a 2-worker expert job holds every expert variable and its Adam moments whole
/// (`[E, ...]` under the one-process names, no `/shard_<i>`), so it resumes in one process with
/// no strategy and at 4 workers (1 expert each) with the next step's loss of the uninterrupted
/// 2-worker job (within 1e-6 relative); and the one process's checkpoint of that step resumes
/// at 2 workers with the uninterrupted job's step 5.
#[test]
fn an_expert_checkpoint_saved_at_two_workers_resumes_in_one_process_and_at_four() {
    let dir = scratch("expert-checkpoint");
    let graph = tiny_moe_gpt(&dir, 1, None);
    let two = "examples/gpt/cluster-2workers.json";
    let uninterrupted = moe_run(&graph, Some(two), 5, &dir.join("full"));
    assert_eq!(uninterrupted.len(), 5);
    let saved = dir.join("saved");
    assert_eq!(moe_run(&graph, Some(two), 3, &saved).len(), 3);
    let path = dflow::executor::checkpoint::latest(&saved)
        .unwrap()
        .expect("a checkpoint");
    let tensors = dflow::executor::checkpoint::load(&path).unwrap().tensors;
    assert!(
        !tensors.keys().any(|n| n.contains("/shard_")),
        "shards saved by their per-worker names: {:?}",
        tensors.keys().collect::<Vec<_>>()
    );
    let experts: Vec<_> = tensors
        .iter()
        .filter(|(n, _)| n.contains(".mlp.experts.") || n.contains("/experts"))
        .collect();
    assert!(
        !experts.is_empty(),
        "{:?}",
        tensors.keys().collect::<Vec<_>>()
    );
    for (n, t) in &experts {
        assert_eq!(t.dims().first(), Some(&4), "`{n}` is {:?}", t.dims());
    }
    assert!(
        experts.iter().any(|(n, _)| n.ends_with("/adam_m")),
        "the experts' optimizer slots: {:?}",
        tensors.keys().collect::<Vec<_>>()
    );
    let copy_of = |from: &Path, name: &str| {
        let copy = dir.join(name);
        std::fs::create_dir_all(&copy).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
        }
        copy
    };
    let next = &uninterrupted[3..4];
    for (cluster, name) in [
        (None, "one"),
        (Some("examples/gpt/cluster-4workers.json"), "four"),
    ] {
        let copy = copy_of(&saved, name);
        let resumed = moe_run(&graph, cluster, 4, &copy);
        let worst = assert_same_losses(&resumed, next, 1e-6);
        eprintln!("resumed {name}: step 4 relative difference {worst:e}");
    }
    // The one process's step-4 checkpoint (experts whole, as it trains them) at 2 workers.
    let back = copy_of(&dir.join("one"), "back");
    let resumed = moe_run(&graph, Some(two), 5, &back);
    let worst = assert_same_losses(&resumed, &uninterrupted[4..], 1e-6);
    eprintln!("one process's checkpoint at 2 workers: step 5 relative difference {worst:e}");
}

/// A uniform router through the strategy: with every router weight zero, each token's router
/// probabilities are exactly 1/E, so the Switch loss α·E·Σ fᵢ·Pᵢ is α·E·(Σ fᵢ)/E = α whatever
/// the routing (ties send every token to expert 0). The aux loss reads the all-gathered router
/// outputs of both workers, and the first step's loss (before any update) of the 2-worker job
/// with α = 0.01 exceeds the same job's with α = 0 by α per MoE layer (2 layers: 0.02), to the
/// f32 rounding of a loss near 4.
#[test]
fn a_uniform_router_adds_exactly_alpha_to_the_two_worker_loss() {
    use dflow::graph::layers::{gpt, GptConfig, MoeConfig};
    use dflow::graph::AttrValue;
    let dir = scratch("expert-uniform");
    let mut first = Vec::new();
    for alpha in [0.01, 0.0] {
        let cfg = GptConfig {
            block_size: 16,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            moe: Some(MoeConfig {
                num_experts: 4,
                top_k: 1,
                capacity_factor: 4.0,
                aux_loss_coef: alpha,
            }),
            ..GptConfig::default()
        };
        let mut def = gpt(&cfg).unwrap().def;
        let routers: Vec<_> = def
            .nodes
            .iter_mut()
            .filter(|n| n.op == "Variable" && n.name.ends_with(".router.weight"))
            .collect();
        assert_eq!(routers.len(), 2);
        for n in routers {
            n.attrs
                .insert("initializer".into(), AttrValue::String("zeros".into()));
            n.attrs.remove("stddev");
            n.attrs.remove("seed");
        }
        let graph = dir.join(format!("uniform-{alpha}.json"));
        std::fs::write(&graph, dflow::graph::format::to_json(&def)).unwrap();
        let losses = moe_run(
            &graph,
            Some("examples/gpt/cluster-2workers.json"),
            1,
            &dir.join(format!("ckpt-{}", (alpha * 100.0) as u32)),
        );
        assert_eq!(losses.len(), 1);
        first.push(losses[0].1);
    }
    let aux = first[0] - first[1];
    assert!(
        (aux - 2.0 * 0.01).abs() <= 2e-6,
        "first losses {first:?}: the two layers' aux losses are {aux}, not 2α = 0.02"
    );
}

/// The `moe/dropped` values the chief reports per step (`/job:worker/replica:0/task:0: step S:
/// moe/dropped N` lines of its stderr), in step order.
fn dropped_per_step(stderr: &str) -> Vec<(u64, f64)> {
    stderr
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once("/task:0: step ")?;
            let (step, values) = rest.split_once(": ")?;
            let value = values
                .split(", ")
                .find_map(|v| v.strip_prefix("moe/dropped "))?;
            Some((step.parse().ok()?, value.trim().parse().ok()?))
        })
        .collect()
}

/// Dropped tokens through the strategy, on a 2-process job: with every router weight zero
/// (and a learning rate of 1e-30, so they stay zero to within what a softmax can see), every
/// token's router probabilities tie and its top-k choices are experts `0..k` (ties go to the
/// lower index). Each worker routes its own T = 64 tokens against the per-worker capacity
/// C = min(T, ceil(T/E · cf)), so per worker and MoE layer the loads are T on experts `0..k`
/// and 0 elsewhere, and the job drops Σ over workers and layers of Σᵢ max(0, loadᵢ − C). The
/// chief reports the all-reduced count every step; this test computes the sum from the forced
/// routing alone, for top-1 and top-2 at capacity factor 1 (C = 16) and top-1 at 2 (C = 32).
#[test]
fn a_forced_skewed_router_drops_the_tokens_over_capacity_summed_over_two_workers() {
    use dflow::graph::AttrValue;
    let _serial = serial();
    let dir = scratch("expert-dropped");
    let (workers, experts, layers, steps) = (2usize, 4usize, 2usize, 3u64);
    // 8 sequences of 16 tokens per step, half per worker.
    let tokens = 8 * 16 / workers;
    for (top_k, cf) in [(1usize, 1.0f64), (2, 1.0), (1, 2.0)] {
        let cfg = GptConfig {
            block_size: 16,
            n_layer: layers,
            n_head: 2,
            n_embd: 16,
            learning_rate: 1e-30,
            min_lr: 0.0,
            moe: Some(MoeConfig {
                num_experts: experts,
                top_k,
                capacity_factor: cf,
                ..MoeConfig::default()
            }),
            ..GptConfig::default()
        };
        let mut def = gpt(&cfg).unwrap().def;
        for n in def
            .nodes
            .iter_mut()
            .filter(|n| n.op == "Variable" && n.name.ends_with(".router.weight"))
        {
            n.attrs
                .insert("initializer".into(), AttrValue::String("zeros".into()));
            n.attrs.remove("stddev");
            n.attrs.remove("seed");
        }
        let graph = dir.join(format!("skewed-top{top_k}-cf{cf}.json"));
        std::fs::write(&graph, dflow::graph::format::to_json(&def)).unwrap();
        let graph_s = graph.to_string_lossy().into_owned();

        // The forced routing: every token's choices are experts 0..k.
        let capacity = ((tokens as f64 / experts as f64 * cf).ceil() as usize).min(tokens);
        let loads: Vec<usize> = (0..experts)
            .map(|e| if e < top_k { tokens } else { 0 })
            .collect();
        let per_worker_layer: usize = loads.iter().map(|&l| l.saturating_sub(capacity)).sum();
        let expected = (workers * layers * per_worker_layer) as f64;
        assert!(expected > 0.0, "the forced routing must drop tokens");

        let cluster = Cluster::new(0, workers);
        let common = vec![
            "--data",
            "examples/data/shakespeare.txt.gz",
            "--batch-size",
            "8",
            "--steps",
            "3",
            "--eval-batches",
            "1",
            "--quiet",
            "--strategy",
            "expert",
        ];
        let other = Task::start(&cluster, "worker", 1, &common);
        let mut chief_args = vec![graph_s.as_str()];
        chief_args.extend(common.iter().copied());
        let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
        chief.assert_success();
        other.wait(Duration::from_secs(30)).assert_success();
        let reported = dropped_per_step(&chief.stderr);
        assert_eq!(
            reported,
            (1..=steps).map(|s| (s, expected)).collect::<Vec<_>>(),
            "top-{top_k}, cf {cf}, C = {capacity}: loads {loads:?} per worker and layer; stderr:\n{}",
            chief.stderr
        );
        eprintln!(
            "top-{top_k}, cf {cf}: C = {capacity}, {expected} dropped per step (reported {reported:?})"
        );
    }
}
