//! Builds the digits MLP with the Rust builder API and prints a summary.
//!
//! Run: `cargo run -p dflow-examples --example build_mlp`

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let g = dflow_examples::mlp()?;
    let (vars, params, bytes) = g.parameter_stats();
    println!("nodes: {}, edges: {}", g.num_nodes(), g.num_edges());
    println!("variables: {vars}, parameters: {params} ({bytes} bytes)");
    for idx in g.node_indices() {
        let n = g.node(idx);
        let types: Vec<String> = n.outputs.iter().map(|t| t.to_string()).collect();
        println!(
            "  {:<16} {:<36} {:<22} {}",
            n.name,
            n.op,
            n.device,
            types.join(", ")
        );
    }
    Ok(())
}
