//! Send and Recv: the two halves of a cross-device edge, inserted by the partitioner.
//!
//! A pair shares `tensor_name`, `send_device` and `recv_device`; together they form the
//! rendezvous key `send_device;recv_device;tensor_name`. With `client_terminated`, one end is
//! the client (a feed enters through a Recv, a fetch leaves through a Send).

use super::*;

/// Name of the pseudo-device that stands for the client in client-terminated pairs.
pub const CLIENT_DEVICE: &str = "/job:client/replica:0/task:0/device:CPU:0";

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(
        OpDef::new(
            "Send",
            "Sends its input to `recv_device` under the rendezvous key.",
            |_| Ok(vec![]),
        )
        .inputs([arg("tensor")])
        .attrs([
            attr("tensor_name", AttrType::String),
            attr("send_device", AttrType::String),
            attr("recv_device", AttrType::String),
            attr_or(
                "client_terminated",
                AttrType::Bool,
                AttrDefault::Bool(false),
            ),
        ])
        .stateful(),
    );
    r.add(
        OpDef::new(
            "Recv",
            "Receives the tensor sent under the rendezvous key; dtype and shape are known statically.",
            |ctx| Ok(vec![TensorType::new(ctx.dtype("dtype")?, ctx.shape("shape")?.clone())]),
        )
        .outputs([arg("tensor")])
        .attrs([
            attr("tensor_name", AttrType::String),
            attr("send_device", AttrType::String),
            attr("recv_device", AttrType::String),
            attr_or("client_terminated", AttrType::Bool, AttrDefault::Bool(false)),
            attr("dtype", AttrType::DType),
            attr_or("shape", AttrType::Shape, AttrDefault::UnknownShape),
        ])
        .stateful(),
    );
}
