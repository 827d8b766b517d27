//! The job plan is the source of truth for slots: for the digits parameter-server and
//! all-reduce jobs, the receive slots and send routes every task registers on its data plane
//! are exactly the plan's for that task (count, global ids, keys, peers, bytes), and a
//! registration that disagrees with its partitions fails naming the pair.

use dflow_executor::cluster::protocol::{DataKind, DataSpec, RegisterGraph};
use dflow_executor::cluster::server::RegisteredSlot;
use dflow_executor::cluster::{task_registrations, ServerOptions, TaskServer};
use dflow_executor::data::{read_csv, ReadOptions};
use dflow_graph::train::TrainSpec;
use dflow_graph::RendezvousKey;
use dflow_graph::{ClusterSpec, Graph};
use dflow_partitioner::{JobInput, JobPlan, StrategyKind, StrategyOptions};
use dflow_transport::tcp::TcpPlane;
use dflow_transport::TcpConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn digits() -> (Graph, TrainSpec) {
    let text = std::fs::read_to_string(root().join("examples/digits/digits.json")).unwrap();
    let parsed = dflow_graph::format::parse_json(&text, None).unwrap();
    let spec = parsed.def.train.clone().unwrap();
    (Graph::from_def(&parsed.def).unwrap(), spec)
}

fn data_spec() -> DataSpec {
    let path = root().join("examples/data/digits.csv.gz");
    let rows = read_csv(&path, &ReadOptions::default()).unwrap().len() as u64;
    DataSpec {
        path: path.display().to_string(),
        seed: 0,
        kind: DataKind::Csv {
            test_fraction: 0.2,
            rows,
        },
    }
}

fn plan(strategy: &str, cluster: &ClusterSpec) -> JobPlan {
    let (graph, spec) = digits();
    let strategy = strategy
        .parse::<StrategyKind>()
        .unwrap()
        .build(&StrategyOptions::default())
        .unwrap();
    let input = JobInput::new(&graph, &spec, cluster, "pixels", "labels");
    strategy.plan(&input).unwrap()
}

/// One task server per task, each on its own TCP data plane (registration needs no peer).
fn servers(
    rt: &tokio::runtime::Runtime,
    regs: &BTreeMap<String, Vec<RegisterGraph>>,
) -> BTreeMap<String, TaskServer> {
    regs.keys()
        .map(|task| {
            let plane = rt
                .block_on(TcpPlane::bind(
                    task,
                    "127.0.0.1:0".parse().unwrap(),
                    TcpConfig::default(),
                ))
                .unwrap();
            let opts = ServerOptions {
                num_threads: 1,
                ..ServerOptions::default()
            };
            (task.clone(), TaskServer::new(task, plane, &opts).unwrap())
        })
        .collect()
}

fn plan_slots(plan: &JobPlan, task: &str) -> Vec<RegisteredSlot> {
    plan.recv_slots(task)
        .iter()
        .map(|s| RegisteredSlot {
            slot: s.slot.slot as u32,
            key: s.slot.key.clone(),
            peer: s.peer.to_string(),
            bytes: s.slot.bytes,
        })
        .collect()
}

fn plan_routes(plan: &JobPlan, task: &str) -> Vec<(RendezvousKey, String, u32)> {
    let mut v: Vec<(RendezvousKey, String, u32)> = plan
        .send_routes(task)
        .iter()
        .map(|s| (s.slot.key.clone(), s.peer.to_string(), s.slot.slot as u32))
        .collect();
    v.sort();
    v
}

/// Registers every task's graphs and checks that each task registered exactly its plan slots.
fn registered_slots_equal_the_plan(strategy: &str, cluster: ClusterSpec, tasks: usize) {
    let plan = plan(strategy, &cluster);
    let regs = task_registrations(&plan, &data_spec()).unwrap();
    assert_eq!(regs.len(), tasks, "{:?}", regs.keys());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let servers = servers(&rt, &regs);
    let mut total = 0;
    for (task, graphs) in &regs {
        let server = &servers[task];
        for g in graphs {
            server
                .register(g)
                .unwrap_or_else(|e| panic!("{task} graph {}: {e}", g.handle));
        }
        let got = server.registered_slots();
        let want = plan_slots(&plan, task);
        assert_eq!(got, want, "{strategy}: {task}'s receive slots");
        assert_eq!(
            server.registered_routes(),
            plan_routes(&plan, task),
            "{strategy}: {task}'s send routes"
        );
        total += got.len();
    }
    // Every slot of the plan is registered by exactly one task, and ids are global.
    assert_eq!(total, plan.buffer_plan.slots.len());
    assert!(total > 0, "{strategy}: the job moves tensors between tasks");
    let mut ids: Vec<usize> = plan.buffer_plan.slots.iter().map(|s| s.slot).collect();
    ids.dedup();
    assert_eq!(ids, (0..total).collect::<Vec<_>>());
}

#[test]
fn digits_ps_tasks_register_exactly_the_plans_slots() {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    registered_slots_equal_the_plan("ps", cluster, 3);
}

#[test]
fn digits_allreduce_tasks_register_exactly_the_plans_slots() {
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    let plan = plan("allreduce", &cluster);
    // All-reduce moves gradients through collectives, not Send/Recv: each worker's graph is
    // whole, so no pair crosses between tasks and no slot is registered.
    assert!(plan.buffer_plan.slots.is_empty());
    let regs = task_registrations(&plan, &data_spec()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let servers = servers(&rt, &regs);
    for (task, graphs) in &regs {
        for g in graphs {
            servers[task].register(g).unwrap();
        }
        assert_eq!(servers[task].registered_slots(), plan_slots(&plan, task));
        assert!(servers[task].registered_routes().is_empty());
    }
    assert_eq!(plan.groups.len(), 1);
    assert_eq!(
        plan.groups[0].members,
        regs.keys().cloned().collect::<Vec<_>>()
    );
}

/// The ps and its first graph that receives from another task.
fn ps_training_graph(regs: &BTreeMap<String, Vec<RegisterGraph>>) -> (String, RegisterGraph) {
    let ps = "/job:ps/replica:0/task:0".to_string();
    let g = regs[&ps]
        .iter()
        .find(|g| !g.recv_slots.is_empty())
        .cloned()
        .unwrap();
    (ps, g)
}

fn register_one(task: &str, g: &RegisterGraph) -> Result<(), String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let regs = BTreeMap::from([(task.to_string(), vec![g.clone()])]);
    let servers = servers(&rt, &regs);
    servers[task].register(g)
}

#[test]
fn a_slot_sized_unlike_the_plan_or_missing_is_an_error_naming_the_pair() {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    let plan = plan("ps", &cluster);
    let regs = task_registrations(&plan, &data_spec()).unwrap();
    let (ps, good) = ps_training_graph(&regs);
    let key = good.recv_slots[0].key.clone();

    let mut wrong_bytes = good.clone();
    wrong_bytes.recv_slots[0].bytes += 4;
    let e = register_one(&ps, &wrong_bytes).unwrap_err();
    assert!(
        e.contains(&format!("pair {key}")) && e.contains("bytes"),
        "{e}"
    );

    let mut wrong_shape = good.clone();
    wrong_shape.recv_slots[0].dims.push(2);
    wrong_shape.recv_slots[0].bytes *= 2;
    let e = register_one(&ps, &wrong_shape).unwrap_err();
    assert!(
        e.contains(&format!("pair {key}")) && e.contains("Recv"),
        "{e}"
    );

    let mut missing = good.clone();
    missing.recv_slots.remove(0);
    let e = register_one(&ps, &missing).unwrap_err();
    assert!(
        e.contains(&format!("pair {key}")) && e.contains("lists no slot"),
        "{e}"
    );

    let mut extra = good.clone();
    let mut stray = good.recv_slots[0].clone();
    stray.key = RendezvousKey::new(
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:ps/replica:0/task:0/device:CPU:0",
        "nothing:0",
    );
    stray.slot = 999;
    extra.recv_slots.push(stray);
    let e = register_one(&ps, &extra).unwrap_err();
    assert!(
        e.contains("nothing:0") && e.contains("none of its partitions receives"),
        "{e}"
    );

    register_one(&ps, &good).unwrap();
}

#[test]
fn a_key_keeps_its_slot_across_graphs() {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    let plan = plan("ps", &cluster);
    let regs = task_registrations(&plan, &data_spec()).unwrap();
    let (ps, good) = ps_training_graph(&regs);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let servers = servers(&rt, &BTreeMap::from([(ps.clone(), vec![])]));
    servers[&ps].register(&good).unwrap();
    let mut renumbered = good.clone();
    renumbered.handle += 100;
    renumbered.recv_slots[0].slot += 1000;
    let e = servers[&ps].register(&renumbered).unwrap_err();
    assert!(
        e.contains(good.recv_slots[0].key.as_str()) && e.contains("registered earlier as slot"),
        "{e}"
    );
}

/// A worker cluster with the given task indices (an elastic job's survivors may have gaps).
fn workers(indices: &[u32]) -> ClusterSpec {
    let tasks = indices
        .iter()
        .map(|&i| (i, format!("127.0.0.1:{}", 3000 + i)))
        .collect();
    ClusterSpec::new(BTreeMap::from([("worker".to_string(), tasks)])).unwrap()
}

#[test]
fn a_reset_task_drops_its_graphs_and_variables_and_registers_the_survivors_plan() {
    use dflow_executor::cluster::protocol::{NamedTensor, WireTensor};
    let task = "/job:worker/replica:0/task:2";
    // Worker 2 of three, then worker 2 of the survivors {0, 2} (the second part of the batch).
    let before =
        task_registrations(&plan("allreduce", &workers(&[0, 1, 2])), &data_spec()).unwrap();
    let after = task_registrations(&plan("allreduce", &workers(&[0, 2])), &data_spec()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let servers = servers(&rt, &before);
    let server = &servers[task];
    for g in &before[task] {
        server.register(g).unwrap();
    }
    let specs = server.variable_specs();
    assert!(specs.contains_key("w1"), "{specs:?}");
    let (_, dtype, dims) = specs["w1"].clone();
    let value = dflow_graph::Tensor::zeros(dtype, &dims).unwrap();
    let set = |s: &TaskServer| {
        s.set_variables(&[NamedTensor {
            name: "w1".into(),
            value: WireTensor::from_tensor(&value),
        }])
    };
    set(server).unwrap();
    assert!(!server.variables().is_empty());

    server.reset();
    assert!(server.variables().is_empty(), "the variables are dropped");
    assert!(server.variable_specs().is_empty(), "the graphs are dropped");
    let e = set(server).unwrap_err();
    assert!(e.contains("w1"), "{e}");

    for g in &after[task] {
        server.register(g).unwrap();
    }
    assert_eq!(
        server.variable_specs().keys().collect::<Vec<_>>(),
        specs.keys().collect::<Vec<_>>()
    );
    set(server).unwrap();
}
