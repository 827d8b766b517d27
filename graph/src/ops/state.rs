//! Sources, sinks and state: Const, Placeholder, Variable, Identity, NoOp.

use super::*;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(
        OpDef::new(
            "Const",
            "A constant tensor given by its `value` attribute.",
            |ctx| {
                let t = ctx.tensor("value")?;
                Ok(vec![TensorType::new(t.dtype(), t.shape())])
            },
        )
        .outputs([arg("output")])
        .attrs([attr("value", AttrType::Tensor)]),
    );
    r.add(
        OpDef::new(
            "Placeholder",
            "A value fed by the client at each step.",
            |ctx| {
                Ok(vec![TensorType::new(
                    ctx.dtype("dtype")?,
                    ctx.shape("shape")?.clone(),
                )])
            },
        )
        .outputs([arg("output")])
        .attrs([
            attr("dtype", AttrType::DType),
            attr_or("shape", AttrType::Shape, AttrDefault::UnknownShape),
        ]),
    );
    r.add(
        OpDef::new(
            "Variable",
            "Trainable state that persists across steps; its output is the current value.",
            |ctx| {
                let shape = ctx.shape("shape")?;
                if !shape.is_static() {
                    return Err(format!("variable shape {shape} must be fully known"));
                }
                Ok(vec![TensorType::new(ctx.dtype("dtype")?, shape.clone())])
            },
        )
        .outputs([arg("ref")])
        .attrs([
            attr("dtype", AttrType::DType),
            attr("shape", AttrType::Shape),
            attr_or("initializer", AttrType::String, AttrDefault::Str("zeros")),
            attr_or("seed", AttrType::Int, AttrDefault::Int(0)),
        ])
        .variable(),
    );
    r.add(
        OpDef::new("Identity", "Passes its input through.", same_as_input)
            .inputs([arg("input")])
            .outputs([arg("output")]),
    );
    r.add(
        OpDef::new(
            "NoOp",
            "Does nothing; a target for control dependencies.",
            |_| Ok(vec![]),
        )
        .stateful(),
    );
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]); a module so the block can follow the
/// tests.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy};

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Identity", |_, _, dys| {
            Ok(vec![Some(only_dy(dys)?.clone())])
        });
        // Sources: nothing flows further back (they have no inputs).
        for op in ["Const", "Placeholder", "Variable"] {
            r.set_gradient(op, no_gradient);
        }
    }
}
