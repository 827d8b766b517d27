//! Running one op's CPU kernel outside a graph, for tests and benchmarks.
//!
//! ```
//! use dflow_graph::ops::testing::run_kernel;
//! use dflow_graph::Tensor;
//! let x = Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
//! let y = Tensor::scalar(10.0f32);
//! let out = run_kernel("Add", &[], &[x, y]).unwrap();
//! assert_eq!(out[0].as_slice::<f32>().unwrap(), &[11.0, 12.0]);
//! ```

use super::{registry, InferCtx, TensorType};
use crate::kernel::{Kernel, KernelContext, KernelInit, VariableCell};
use crate::OpError;
use crate::{AttrValue, Tensor};
use std::collections::BTreeMap;

/// Declared defaults of op `op` overlaid with `attrs` (unknown names are an error).
pub fn attrs_with_defaults(
    op: &str,
    attrs: &[(&str, AttrValue)],
) -> Result<BTreeMap<String, AttrValue>, String> {
    let def = registry()
        .get(op)
        .ok_or_else(|| format!("unknown op `{op}`"))?;
    let mut map: BTreeMap<String, AttrValue> = def
        .attrs
        .iter()
        .filter_map(|a| Some((a.name.to_string(), a.default.value()?)))
        .collect();
    for (k, v) in attrs {
        if def.attr(k).is_none() {
            return Err(format!("{op} has no attribute `{k}`"));
        }
        map.insert(k.to_string(), v.clone());
    }
    Ok(map)
}

/// Builds op `op`'s CPU kernel, as the executor would for node `node`.
pub fn build_kernel(
    op: &str,
    node: &str,
    attrs: &BTreeMap<String, AttrValue>,
    input_types: &[TensorType],
) -> Result<Box<dyn Kernel>, OpError> {
    let def = registry()
        .get(op)
        .ok_or_else(|| format!("unknown op `{op}`"))?;
    let output_types = (def.infer)(&InferCtx {
        node,
        inputs: input_types,
        attrs,
    })
    .map_err(|e| format!("shape rule: {e}"))?;
    let factory = def
        .kernel_for(&crate::DeviceType::CPU)
        .ok_or_else(|| format!("{op} has no CPU kernel"))?;
    factory(&KernelInit {
        node,
        attrs,
        input_types,
        output_types: &output_types,
    })
}

/// Runs op `op`'s CPU kernel once on `inputs`, with the declared attribute defaults filled in
/// and the inputs' exact types as the static types. A variable op gets a fresh cell.
pub fn run_kernel(
    op: &str,
    attrs: &[(&str, AttrValue)],
    inputs: &[Tensor],
) -> Result<Vec<Tensor>, String> {
    let types: Vec<TensorType> = inputs
        .iter()
        .map(|t| TensorType::new(t.dtype(), t.shape()))
        .collect();
    run_kernel_with(
        op,
        "node",
        attrs,
        &types,
        inputs,
        &[std::sync::Arc::new(VariableCell::default())],
    )
}

/// Like [`run_kernel`], but with explicit node name, static input types (e.g. with unknown dims,
/// to reach the kernels' runtime checks) and variable cell.
pub fn run_kernel_with(
    op: &str,
    node: &str,
    attrs: &[(&str, AttrValue)],
    input_types: &[TensorType],
    inputs: &[Tensor],
    variables: &[std::sync::Arc<VariableCell>],
) -> Result<Vec<Tensor>, String> {
    let attrs = attrs_with_defaults(op, attrs)?;
    let kernel = build_kernel(op, node, &attrs, input_types)?;
    // The shape rule decides the output count (ops with a repeated output, like Split).
    let n_out = output_count(op, node, &attrs, input_types)?;
    let mut outputs = vec![None; n_out];
    let inputs: Vec<&Tensor> = inputs.iter().collect();
    let mut ctx = KernelContext {
        node,
        inputs: &inputs,
        variables,
        step: 0,
        outputs: &mut outputs,
        collectives: None,
        output_memory: None,
    };
    kernel.compute(&mut ctx)?;
    outputs
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.ok_or_else(|| format!("{op}: kernel did not set output {i}")))
        .collect()
}

/// How many outputs node `node` of op `op` has: what its shape rule returns.
fn output_count(
    op: &str,
    node: &str,
    attrs: &BTreeMap<String, AttrValue>,
    input_types: &[TensorType],
) -> Result<usize, String> {
    let def = registry()
        .get(op)
        .ok_or_else(|| format!("unknown op `{op}`"))?;
    let outs = (def.infer)(&InferCtx {
        node,
        inputs: input_types,
        attrs,
    })
    .map_err(|e| format!("shape rule: {e}"))?;
    Ok(outs.len())
}
