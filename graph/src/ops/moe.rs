//! Mixture of experts (Switch Transformer, GShard) with static shapes: routing, dispatch into a
//! fixed `[E, C, d]` buffer, combine, and the Switch load-balancing loss.
//!
//! An MoE MLP over `x [N, d]` (N tokens) with `E` experts is
//!
//! ```text
//! probs             = Softmax(x · routerᵀ)                    [N, E]
//! expert, slot, gate, dropped, load = MoeRoute(probs)         [N, k] ×3, [], [E]
//! buf               = MoeDispatch(x, expert, slot)            [E, C, d]
//! out               = the experts' MLPs, batched over E       [E, C, d]
//! y                 = MoeCombine(out, expert, slot, gate)     [N, d]
//! aux               = MoeAuxLoss(probs, expert)               []
//! ```
//!
//! - **Routing** (`MoeRoute`): each token picks its `k` (1 or 2) most probable experts (ties go
//!   to the lower index). The capacity of every expert is `C = min(N, ceil(N / E ·
//!   capacity_factor))` ([`capacity`]), the same in every kernel because it depends only on the
//!   run-time token count and attributes. Slots are handed out first to every token's first
//!   choice in token order, then to the second choices (GShard's priority); an assignment that
//!   finds its expert full is dropped (`slot = -1`): it contributes nothing, so a token dropped
//!   by all its experts passes through the residual connection unchanged. `dropped` counts the
//!   dropped assignments, which is Σᵢ max(0, loadᵢ − C) with `load` the assignments per expert.
//!   The gate of top-1 is the chosen expert's probability (Switch); top-2 gates are the two
//!   probabilities normalized to sum to 1 (GShard). Gates are a function of `probs` only
//!   (a dropped assignment keeps its gate; the combine ignores it), so their gradient
//!   (`MoeRouteGrad`) does not depend on the capacity.
//! - **Dispatch / combine**: `buf[e, s] = x[n]` for every kept assignment `(n, j)` with
//!   `expert[n, j] = e`, `slot[n, j] = s`; empty slots are zero. `y[n] = Σⱼ gate[n, j] ·
//!   out[expert[n, j], slot[n, j]]` over kept assignments. The gradient of dispatch is the
//!   unweighted combine (`MoeDispatchGrad`); that of combine is a weighted dispatch of `dy` and
//!   the dot products `dy[n] · out[e, s]` (`MoeCombineGrad`).
//! - **Load-balancing loss** (`MoeAuxLoss`): `α · E · Σᵢ fᵢ · Pᵢ` with `fᵢ` the fraction of
//!   tokens whose first choice is expert `i` and `Pᵢ` the mean router probability of `i`
//!   (Switch Transformer, eq. 4; α = 0.01 by default). Only `Pᵢ` is differentiable:
//!   d/dprobs[n, i] = α · E · fᵢ / N. A uniform router gives exactly α.
//!
//! Kernels support f32 and f64 (sums of products in f64).
//!
//! **Causality with top-2:** slots go to all first choices before any second choice, so in a
//! decoder a later token's first choice can take the slot an earlier token's second choice
//! wanted (GShard's priority has the same property). Top-1 routing has no such dependence
//! within a sequence: a token's slot depends only on the tokens before it in the flattened
//! `[batch · time]` order.

use super::elementwise::{attr_float, attr_int, slice};
use super::grad::{dispatch_real, Real};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(moe_route());
    r.add(moe_route_grad());
    r.add(moe_dispatch());
    r.add(moe_dispatch_grad());
    r.add(moe_combine());
    r.add(moe_combine_grad());
    r.add(moe_aux_loss());
    r.add(moe_aux_loss_grad());
}

/// The default coefficient α of the Switch load-balancing loss.
pub const DEFAULT_AUX_LOSS_COEF: f64 = 0.01;

/// The slots per expert for `tokens` tokens over `experts` experts: `ceil(tokens / experts ·
/// capacity_factor)`, at most `tokens` (an expert can never receive more), 0 without experts.
pub fn capacity(tokens: usize, experts: usize, capacity_factor: f64) -> usize {
    if experts == 0 {
        return 0;
    }
    let c = (tokens as f64 / experts as f64 * capacity_factor).ceil();
    // `as` saturates: a huge factor gives usize::MAX, then `tokens`.
    (c.max(0.0) as usize).min(tokens)
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

fn check_k(op: &str, k: i64) -> Result<usize, String> {
    match k {
        1 | 2 => Ok(k as usize),
        _ => Err(format!("{op}: k must be 1 or 2, got {k}")),
    }
}

fn check_factor(op: &str, f: f64) -> Result<f64, String> {
    if f.is_finite() && f > 0.0 {
        Ok(f)
    } else {
        Err(format!(
            "{op}: capacity_factor must be finite and > 0, got {f}"
        ))
    }
}

/// The most experts one MoE layer may have: a bound on the dispatch buffer a graph file can ask
/// for (`[E, C, d]` with C >= 1).
pub const MAX_EXPERTS: usize = 1 << 16;

fn check_experts(op: &str, e: i64) -> Result<usize, String> {
    usize::try_from(e)
        .ok()
        .filter(|&e| (1..=MAX_EXPERTS).contains(&e))
        .ok_or_else(|| format!("{op}: num_experts must be in [1, {MAX_EXPERTS}], got {e}"))
}

fn check_alpha(op: &str, a: f64) -> Result<f64, String> {
    if a.is_finite() {
        Ok(a)
    } else {
        Err(format!("{op}: alpha must be finite, got {a}"))
    }
}

/// Static check: `t` is `[N, width]` (rank 2) of dtype `dtype` when given; returns its dims.
fn rank2(
    op: &str,
    what: &str,
    t: &TensorType,
    dtype: Option<DType>,
) -> Result<(Option<usize>, Option<usize>), String> {
    if let Some(d) = dtype {
        if t.dtype != d {
            return Err(format!("{op}: {what} must be {d}, got {t}"));
        }
    }
    match t.shape.dims() {
        Some([a, b]) => Ok((*a, *b)),
        Some(_) => Err(format!(
            "{op}: {what} must have rank 2, got shape {}",
            t.shape
        )),
        None => Ok((None, None)),
    }
}

/// Two optional static dimensions that must agree.
fn same_dim(
    op: &str,
    what: &str,
    a: Option<usize>,
    b: Option<usize>,
) -> Result<Option<usize>, String> {
    match (a, b) {
        (Some(x), Some(y)) if x != y => Err(format!("{op}: {what}: {x} vs {y}")),
        (Some(x), _) | (_, Some(x)) => Ok(Some(x)),
        _ => Ok(None),
    }
}

/// The routing of one step, checked at run time: `expert` and `slot` i64 `[N, k]`, every
/// expert in `[0, E)`, every slot in `[-1, C)`, no buffer slot used twice.
struct Routing<'a> {
    n: usize,
    k: usize,
    expert: &'a [i64],
    slot: &'a [i64],
}

impl<'a> Routing<'a> {
    fn check(
        op: &str,
        node: &str,
        expert: &'a Tensor,
        slot: &'a Tensor,
        e: usize,
        c: usize,
    ) -> Result<Self, String> {
        if expert.dtype() != DType::I64 || slot.dtype() != DType::I64 {
            return Err(format!(
                "{op} `{node}`: expert and slot must be i64, got {} and {}",
                expert.dtype(),
                slot.dtype()
            ));
        }
        let (n, k) = match expert.dims() {
            [n, k] if slot.dims() == [*n, *k] => (*n, *k),
            _ => {
                return Err(format!(
                    "{op} `{node}`: expert {} and slot {} must both be [N, k]",
                    expert.shape(),
                    slot.shape()
                ))
            }
        };
        let (es, ss) = (slice::<i64>(expert)?, slice::<i64>(slot)?);
        let mut used = vec![false; e * c];
        for (i, (&x, &s)) in es.iter().zip(ss).enumerate() {
            let at = || format!("token {}, choice {}", i / k.max(1), i % k.max(1));
            if x < 0 || x as usize >= e {
                return Err(format!(
                    "{op} `{node}`: expert {x} at {} is out of range [0, {e})",
                    at()
                ));
            }
            if s < -1 || (s >= 0 && s as usize >= c) {
                return Err(format!(
                    "{op} `{node}`: slot {s} at {} is out of range [-1, {c}) (capacity {c}: \
                     do the route and this op have the same capacity_factor?)",
                    at()
                ));
            }
            if s >= 0 {
                let u = &mut used[x as usize * c + s as usize];
                if std::mem::replace(u, true) {
                    return Err(format!(
                        "{op} `{node}`: slot {s} of expert {x} is used twice (at {})",
                        at()
                    ));
                }
            }
        }
        Ok(Routing {
            n,
            k,
            expert: es,
            slot: ss,
        })
    }

    /// The kept assignments: (token, choice index into [N, k], buffer row e·C + s).
    fn kept(&self, c: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.n * self.k).filter_map(move |i| {
            let s = self.slot[i];
            (s >= 0).then(|| (i / self.k, i, self.expert[i] as usize * c + s as usize))
        })
    }
}

fn f64_out<T: Real>(dims: &[usize], v: &[f64]) -> Result<Tensor, String> {
    let v: Vec<T> = v.iter().map(|&x| T::from_f64(x)).collect();
    Tensor::from_slice(dims, &v).map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// MoeRoute
// ---------------------------------------------------------------------------------------------

fn moe_route() -> OpDef {
    OpDef::new(
        "MoeRoute",
        "Top-k routing of N tokens to E experts with capacity C = min(N, ceil(N / E * \
         capacity_factor)) (see the module docs). In: probs [N, E] (f32 or f64; the router's \
         softmax). Out: expert (i64 [N, k]), slot (i64 [N, k], -1 = dropped), gate ([N, k], \
         probs' dtype: top-1 the probability, top-2 the two normalized), dropped (i64 [], \
         dropped assignments), load (i64 [E], assignments per expert before dropping). Attrs: k \
         (int, 1 or 2, default 1), capacity_factor (float > 0, default 1.0).",
        route_infer,
    )
    .inputs([arg("probs")])
    .outputs([
        arg("expert"),
        arg("slot"),
        arg("gate"),
        arg("dropped"),
        arg("load"),
    ])
    .attrs([
        attr_or("k", AttrType::Int, AttrDefault::Int(1)),
        attr_or("capacity_factor", AttrType::Float, AttrDefault::Float(1.0)),
    ])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(RouteKernel {
            k: check_k("MoeRoute", attr_int(init, "k")?)?,
            factor: check_factor("MoeRoute", attr_float(init, "capacity_factor")?)?,
        }))
    })
}

fn route_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    const OP: &str = "MoeRoute";
    let k = check_k(OP, ctx.int("k")?)?;
    check_factor(OP, ctx.float("capacity_factor")?)?;
    let probs = ctx.input(0)?;
    require_float(&format!("{OP}: probs"), probs)?;
    let (n, e) = rank2(OP, "probs", probs, None)?;
    if let Some(e) = e {
        if e < k {
            return Err(format!(
                "{OP}: top-{k} routing needs at least {k} experts, probs {} has {e}",
                probs.shape
            )
            .into());
        }
    }
    let nk = Shape::partial(vec![n, Some(k)]);
    Ok(vec![
        TensorType::new(DType::I64, nk.clone()),
        TensorType::new(DType::I64, nk.clone()),
        TensorType::new(probs.dtype, nk),
        TensorType::new(DType::I64, Shape::known(&[])),
        TensorType::new(DType::I64, Shape::partial(vec![e])),
    ])
}

#[derive(Debug)]
struct RouteKernel {
    k: usize,
    factor: f64,
}

/// The top `k` (≤ 2) entries of `row`, highest first, ties to the lower index; a NaN entry is
/// chosen only when nothing else is left.
fn top_k(row: &[f64], k: usize) -> [usize; 2] {
    let pick = |skip: Option<usize>| {
        let mut best: Option<usize> = None;
        for (i, &p) in row.iter().enumerate() {
            if Some(i) == skip || p.is_nan() {
                continue;
            }
            match best {
                Some(b) if p <= row[b] => {}
                _ => best = Some(i),
            }
        }
        // All NaN (or skipped): the first index not skipped.
        best.unwrap_or(usize::from(skip == Some(0)))
    };
    let first = pick(None);
    [first, if k == 2 { pick(Some(first)) } else { 0 }]
}

/// The gates of one token's choices (see the module docs): 0 where the top-2 sum is not > 0.
fn gates(p: &[f64], k: usize) -> [f64; 2] {
    if k == 1 {
        return [p[0], 0.0];
    }
    let s = p[0] + p[1];
    if s > 0.0 {
        [p[0] / s, p[1] / s]
    } else {
        [0.0, 0.0]
    }
}

fn route_typed<T: Real>(probs: &Tensor, k: usize, factor: f64) -> Result<Vec<Tensor>, String> {
    let (n, e) = (probs.dims()[0], probs.dims()[1]);
    let ps = slice::<T>(probs)?;
    let c = capacity(n, e, factor);
    let mut expert = vec![0i64; n * k];
    let mut gate = vec![0f64; n * k];
    let mut row = vec![0f64; e];
    for t in 0..n {
        for (r, &p) in row.iter_mut().zip(&ps[t * e..(t + 1) * e]) {
            *r = p.to_f64();
        }
        let best = top_k(&row, k);
        let chosen = [row[best[0]], if k == 2 { row[best[1]] } else { 0.0 }];
        let g = gates(&chosen, k);
        for j in 0..k {
            expert[t * k + j] = best[j] as i64;
            gate[t * k + j] = g[j];
        }
    }
    let mut slot = vec![-1i64; n * k];
    let mut load = vec![0i64; e];
    let mut dropped = 0i64;
    for j in 0..k {
        for t in 0..n {
            let x = expert[t * k + j] as usize;
            if (load[x] as usize) < c {
                slot[t * k + j] = load[x];
            } else {
                dropped += 1;
            }
            load[x] += 1;
        }
    }
    let err = |e: crate::TensorError| e.to_string();
    Ok(vec![
        Tensor::from_slice(&[n, k], &expert).map_err(err)?,
        Tensor::from_slice(&[n, k], &slot).map_err(err)?,
        f64_out::<T>(&[n, k], &gate)?,
        Tensor::scalar(dropped),
        Tensor::from_slice(&[e], &load).map_err(err)?,
    ])
}

impl Kernel for RouteKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let probs = ctx.input(0)?;
        match probs.dims() {
            [_, e] if *e >= self.k => {}
            _ => {
                return Err(format!(
                    "MoeRoute `{}`: probs must be [N, E] with E >= k = {}, got shape {}",
                    ctx.node,
                    self.k,
                    probs.shape()
                )
                .into())
            }
        }
        let outs = dispatch_real!(probs.dtype(), route_typed(probs, self.k, self.factor))?;
        for (i, t) in outs.into_iter().enumerate() {
            ctx.set_output(i, t)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// MoeRouteGrad
// ---------------------------------------------------------------------------------------------

fn moe_route_grad() -> OpDef {
    OpDef::new(
        "MoeRouteGrad",
        "The gradient of MoeRoute's gate output w.r.t. probs. In: dgate [N, k], probs [N, E] \
         (same float dtype), expert (i64 [N, k], MoeRoute's output 0). Out: dprobs [N, E]: \
         top-1 dgate at the chosen expert; top-2 with g the gates and s the sum of the two \
         probabilities, (dgate_a - sum_j dgate_j g_j) / s at choice a.",
        |ctx| {
            const OP: &str = "MoeRouteGrad";
            let (dgate, probs, expert) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_float(&format!("{OP}: probs"), probs)?;
            let (gn, gk) = rank2(OP, "dgate", dgate, Some(probs.dtype))?;
            let (pn, _) = rank2(OP, "probs", probs, None)?;
            let (en, ek) = rank2(OP, "expert", expert, Some(DType::I64))?;
            same_dim(OP, "dgate and expert differ in k", gk, ek)?;
            let n = same_dim(OP, "dgate and probs differ in N", gn, pn)?;
            same_dim(OP, "expert and probs differ in N", en, n)?;
            Ok(vec![probs.clone()])
        },
    )
    .inputs([arg("dgate"), arg("probs"), arg("expert")])
    .outputs([arg("dprobs")])
    .cpu_kernel(|_| Ok(Box::new(RouteGradKernel)))
}

#[derive(Debug)]
struct RouteGradKernel;

fn route_grad_typed<T: Real>(
    dgate: &Tensor,
    probs: &Tensor,
    expert: &[i64],
) -> Result<Tensor, String> {
    let (n, e) = (probs.dims()[0], probs.dims()[1]);
    let k = dgate.dims()[1];
    let (dg, ps) = (slice::<T>(dgate)?, slice::<T>(probs)?);
    let mut out = vec![0f64; n * e];
    for t in 0..n {
        let row = &ps[t * e..(t + 1) * e];
        let ex = &expert[t * k..(t + 1) * k];
        let d = &dg[t * k..(t + 1) * k];
        if k == 1 {
            out[t * e + ex[0] as usize] += d[0].to_f64();
            continue;
        }
        let p = [row[ex[0] as usize].to_f64(), row[ex[1] as usize].to_f64()];
        let s = p[0] + p[1];
        if s <= 0.0 {
            continue;
        }
        let g = gates(&p, 2);
        let dot = d[0].to_f64() * g[0] + d[1].to_f64() * g[1];
        for j in 0..2 {
            out[t * e + ex[j] as usize] += (d[j].to_f64() - dot) / s;
        }
    }
    f64_out::<T>(&[n, e], &out)
}

impl Kernel for RouteGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "MoeRouteGrad";
        let (dgate, probs, expert) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        let ok = match (dgate.dims(), probs.dims(), expert.dims()) {
            ([n, k], [pn, e], [en, ek]) => {
                n == pn && n == en && k == ek && (1..=2).contains(k) && e >= k
            }
            _ => false,
        };
        if !ok || dgate.dtype() != probs.dtype() || expert.dtype() != DType::I64 {
            return Err(format!(
                "{OP} `{}`: dgate {}{} and expert {}{} must be [N, k] (k = 1 or 2, expert \
                 i64) and probs {}{} [N, E] of dgate's dtype",
                ctx.node,
                dgate.dtype(),
                dgate.shape(),
                expert.dtype(),
                expert.shape(),
                probs.dtype(),
                probs.shape()
            )
            .into());
        }
        let e = probs.dims()[1];
        let ex = slice::<i64>(expert)?;
        if let Some((i, x)) = ex
            .iter()
            .enumerate()
            .find(|(_, &x)| x < 0 || x as usize >= e)
        {
            return Err(format!(
                "{OP} `{}`: expert {x} at position {i} is out of range [0, {e})",
                ctx.node
            )
            .into());
        }
        let out = dispatch_real!(probs.dtype(), route_grad_typed(dgate, probs, ex))?;
        ctx.set_output(0, out)
    }
}

// ---------------------------------------------------------------------------------------------
// MoeDispatch and MoeDispatchGrad
// ---------------------------------------------------------------------------------------------

fn capacity_attrs() -> [AttrDef; 2] {
    [
        attr("num_experts", AttrType::Int),
        attr_or("capacity_factor", AttrType::Float, AttrDefault::Float(1.0)),
    ]
}

fn moe_dispatch() -> OpDef {
    OpDef::new(
        "MoeDispatch",
        "buf[expert[n, j], slot[n, j], :] = x[n, :] for every kept assignment (slot >= 0); \
         other slots 0. In: x [N, d] (f32 or f64), expert, slot (i64 [N, k], MoeRoute's outputs \
         0 and 1). Out: buf [E, C, d], C = min(N, ceil(N / E * capacity_factor)). Attrs: \
         num_experts (int >= 1), capacity_factor (float > 0, default 1.0; MoeRoute's).",
        |ctx| {
            const OP: &str = "MoeDispatch";
            let e = check_experts(OP, ctx.int("num_experts")?)?;
            let f = check_factor(OP, ctx.float("capacity_factor")?)?;
            let (x, expert, slot) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_float(&format!("{OP}: x"), x)?;
            let (xn, d) = rank2(OP, "x", x, None)?;
            let (n, _) = routing_infer(OP, expert, slot)?;
            let n = same_dim(OP, "x and expert differ in N", xn, n)?;
            let c = n.map(|n| capacity(n, e, f));
            Ok(vec![TensorType::new(
                x.dtype,
                Shape::partial(vec![Some(e), c, d]),
            )])
        },
    )
    .inputs([arg("x"), arg("expert"), arg("slot")])
    .outputs([arg("buf")])
    .attrs(capacity_attrs())
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(DispatchKernel {
            experts: check_experts("MoeDispatch", attr_int(init, "num_experts")?)?,
            factor: check_factor("MoeDispatch", attr_float(init, "capacity_factor")?)?,
        }))
    })
}

/// Static check of expert and slot (i64 [N, k], equal shapes); returns (N, k).
fn routing_infer(
    op: &str,
    expert: &TensorType,
    slot: &TensorType,
) -> Result<(Option<usize>, Option<usize>), String> {
    let (en, ek) = rank2(op, "expert", expert, Some(DType::I64))?;
    let (sn, sk) = rank2(op, "slot", slot, Some(DType::I64))?;
    let n = same_dim(op, "expert and slot differ in N", en, sn)?;
    let k = same_dim(op, "expert and slot differ in k", ek, sk)?;
    Ok((n, k))
}

#[derive(Debug)]
struct DispatchKernel {
    experts: usize,
    factor: f64,
}

fn dispatch_typed<T: Real>(
    x: &Tensor,
    r: &Routing<'_>,
    e: usize,
    c: usize,
) -> Result<Tensor, String> {
    let d = x.dims()[1];
    let xs = slice::<T>(x)?;
    let mut out = Tensor::zeros(T::DTYPE, &[e, c, d]).map_err(|e| e.to_string())?;
    let buf = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if d > 0 {
        for (t, _, row) in r.kept(c) {
            buf[row * d..(row + 1) * d].copy_from_slice(&xs[t * d..(t + 1) * d]);
        }
    }
    Ok(out)
}

impl Kernel for DispatchKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "MoeDispatch";
        let (x, expert, slot) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        let Some(&n) = x.dims().first().filter(|_| x.rank() == 2) else {
            return Err(format!(
                "{OP} `{}`: x must be [N, d], got shape {}",
                ctx.node,
                x.shape()
            )
            .into());
        };
        let (e, c) = (self.experts, capacity(n, self.experts, self.factor));
        let r = Routing::check(OP, ctx.node, expert, slot, e, c)?;
        if r.n != n {
            return Err(format!(
                "{OP} `{}`: x has {n} tokens but expert has {}",
                ctx.node, r.n
            )
            .into());
        }
        let buf = dispatch_real!(x.dtype(), dispatch_typed(x, &r, e, c))?;
        ctx.set_output(0, buf)
    }
}

fn moe_dispatch_grad() -> OpDef {
    OpDef::new(
        "MoeDispatchGrad",
        "The gradient of MoeDispatch w.r.t. x: dx[n, :] = sum over kept assignments j of \
         dbuf[expert[n, j], slot[n, j], :]. In: dbuf [E, C, d] (f32 or f64), expert, slot (i64 \
         [N, k]). Out: dx [N, d].",
        |ctx| {
            const OP: &str = "MoeDispatchGrad";
            let (dbuf, expert, slot) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            let d = buf_infer(OP, "dbuf", dbuf)?;
            let (n, _) = routing_infer(OP, expert, slot)?;
            Ok(vec![TensorType::new(
                dbuf.dtype,
                Shape::partial(vec![n, d]),
            )])
        },
    )
    .inputs([arg("dbuf"), arg("expert"), arg("slot")])
    .outputs([arg("dx")])
    .cpu_kernel(|_| Ok(Box::new(DispatchGradKernel)))
}

/// Static check of a float `[E, C, d]` buffer; returns d.
fn buf_infer(op: &str, what: &str, t: &TensorType) -> Result<Option<usize>, String> {
    require_float(&format!("{op}: {what}"), t)?;
    match t.shape.dims() {
        Some([_, _, d]) => Ok(*d),
        Some(_) => Err(format!(
            "{op}: {what} must be [E, C, d], got shape {}",
            t.shape
        )),
        None => Ok(None),
    }
}

/// Run-time check of a `[E, C, d]` buffer; returns (E, C, d).
fn buf_dims(op: &str, node: &str, what: &str, t: &Tensor) -> Result<(usize, usize, usize), String> {
    match t.dims() {
        [e, c, d] => Ok((*e, *c, *d)),
        _ => Err(format!(
            "{op} `{node}`: {what} must be [E, C, d], got shape {}",
            t.shape()
        )),
    }
}

/// `y[n] = Σ gate[n, j] · buf[e, s]` over kept assignments (gate 1 when `None`).
fn combine_typed<T: Real>(
    buf: &Tensor,
    r: &Routing<'_>,
    gate: Option<&Tensor>,
) -> Result<Tensor, String> {
    let (_, c, d) = (buf.dims()[0], buf.dims()[1], buf.dims()[2]);
    let bs = slice::<T>(buf)?;
    let gs = gate.map(slice::<T>).transpose()?;
    let mut out = Tensor::zeros(T::DTYPE, &[r.n, d]).map_err(|e| e.to_string())?;
    let ys = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if d > 0 {
        for (t, i, row) in r.kept(c) {
            let g = gs.map_or(T::from_f64(1.0), |g| g[i]);
            for (y, &v) in ys[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&bs[row * d..(row + 1) * d])
            {
                *y += g * v;
            }
        }
    }
    Ok(out)
}

#[derive(Debug)]
struct DispatchGradKernel;

impl Kernel for DispatchGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "MoeDispatchGrad";
        let (dbuf, expert, slot) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        let (e, c, _) = buf_dims(OP, ctx.node, "dbuf", dbuf)?;
        let r = Routing::check(OP, ctx.node, expert, slot, e, c)?;
        let dx = dispatch_real!(dbuf.dtype(), combine_typed(dbuf, &r, None))?;
        ctx.set_output(0, dx)
    }
}

// ---------------------------------------------------------------------------------------------
// MoeCombine and MoeCombineGrad
// ---------------------------------------------------------------------------------------------

fn moe_combine() -> OpDef {
    OpDef::new(
        "MoeCombine",
        "y[n, :] = sum over kept assignments j (slot >= 0) of gate[n, j] * buf[expert[n, j], \
         slot[n, j], :]; a token with no kept assignment gets 0. In: buf [E, C, d] (f32 or f64), \
         expert, slot (i64 [N, k]), gate ([N, k], buf's dtype). Out: y [N, d].",
        |ctx| {
            const OP: &str = "MoeCombine";
            let (buf, expert, slot, gate) =
                (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?, ctx.input(3)?);
            let d = buf_infer(OP, "buf", buf)?;
            let (n, k) = routing_infer(OP, expert, slot)?;
            let (gn, gk) = rank2(OP, "gate", gate, Some(buf.dtype))?;
            let n = same_dim(OP, "gate and expert differ in N", gn, n)?;
            same_dim(OP, "gate and expert differ in k", gk, k)?;
            Ok(vec![TensorType::new(buf.dtype, Shape::partial(vec![n, d]))])
        },
    )
    .inputs([arg("buf"), arg("expert"), arg("slot"), arg("gate")])
    .outputs([arg("y")])
    .cpu_kernel(|_| Ok(Box::new(CombineKernel)))
}

/// Run-time check of gate against the routing.
fn check_gate(
    op: &str,
    node: &str,
    gate: &Tensor,
    buf: &Tensor,
    r: &Routing<'_>,
) -> Result<(), String> {
    if gate.dims() != [r.n, r.k] || gate.dtype() != buf.dtype() {
        return Err(format!(
            "{op} `{node}`: gate {}{} must be [{}, {}] of buf's dtype {}",
            gate.dtype(),
            gate.shape(),
            r.n,
            r.k,
            buf.dtype()
        ));
    }
    Ok(())
}

#[derive(Debug)]
struct CombineKernel;

impl Kernel for CombineKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "MoeCombine";
        let (buf, expert, slot, gate) =
            (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?, ctx.input(3)?);
        let (e, c, _) = buf_dims(OP, ctx.node, "buf", buf)?;
        let r = Routing::check(OP, ctx.node, expert, slot, e, c)?;
        check_gate(OP, ctx.node, gate, buf, &r)?;
        let y = dispatch_real!(buf.dtype(), combine_typed(buf, &r, Some(gate)))?;
        ctx.set_output(0, y)
    }
}

fn moe_combine_grad() -> OpDef {
    OpDef::new(
        "MoeCombineGrad",
        "The gradient of MoeCombine: dbuf[e, s, :] = gate[n, j] * dy[n, :] for the kept \
         assignment (n, j) at (e, s) (0 at empty slots); dgate[n, j] = dy[n, :] . buf[e, s, :] \
         (0 for dropped assignments). In: dy [N, d], buf [E, C, d], expert, slot (i64 [N, k]), \
         gate [N, k]. Out: dbuf [E, C, d], dgate [N, k].",
        |ctx| {
            const OP: &str = "MoeCombineGrad";
            let dy = ctx.input(0)?;
            let (buf, expert, slot, gate) =
                (ctx.input(1)?, ctx.input(2)?, ctx.input(3)?, ctx.input(4)?);
            let d = buf_infer(OP, "buf", buf)?;
            let (n, k) = routing_infer(OP, expert, slot)?;
            let (yn, yd) = rank2(OP, "dy", dy, Some(buf.dtype))?;
            let (gn, gk) = rank2(OP, "gate", gate, Some(buf.dtype))?;
            let n = same_dim(OP, "dy and expert differ in N", yn, n)?;
            same_dim(OP, "gate and expert differ in N", gn, n)?;
            same_dim(OP, "dy and buf differ in d", yd, d)?;
            same_dim(OP, "gate and expert differ in k", gk, k)?;
            Ok(vec![buf.clone(), gate.clone()])
        },
    )
    .inputs([
        arg("dy"),
        arg("buf"),
        arg("expert"),
        arg("slot"),
        arg("gate"),
    ])
    .outputs([arg("dbuf"), arg("dgate")])
    .cpu_kernel(|_| Ok(Box::new(CombineGradKernel)))
}

#[derive(Debug)]
struct CombineGradKernel;

fn combine_grad_typed<T: Real>(
    dy: &Tensor,
    buf: &Tensor,
    r: &Routing<'_>,
    gate: &Tensor,
) -> Result<Vec<Tensor>, String> {
    let (c, d) = (buf.dims()[1], buf.dims()[2]);
    let (dys, bs, gs) = (slice::<T>(dy)?, slice::<T>(buf)?, slice::<T>(gate)?);
    let mut dbuf = Tensor::zeros(T::DTYPE, buf.dims()).map_err(|e| e.to_string())?;
    let mut dgate = vec![0f64; r.n * r.k];
    let db = dbuf.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if d > 0 {
        for (t, i, row) in r.kept(c) {
            let (dyr, br) = (&dys[t * d..(t + 1) * d], &bs[row * d..(row + 1) * d]);
            for (o, &v) in db[row * d..(row + 1) * d].iter_mut().zip(dyr) {
                *o = gs[i] * v;
            }
            dgate[i] = dyr
                .iter()
                .zip(br)
                .map(|(a, b)| a.to_f64() * b.to_f64())
                .sum();
        }
    }
    Ok(vec![dbuf, f64_out::<T>(&[r.n, r.k], &dgate)?])
}

impl Kernel for CombineGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "MoeCombineGrad";
        let dy = ctx.input(0)?;
        let (buf, expert, slot, gate) =
            (ctx.input(1)?, ctx.input(2)?, ctx.input(3)?, ctx.input(4)?);
        let (e, c, d) = buf_dims(OP, ctx.node, "buf", buf)?;
        let r = Routing::check(OP, ctx.node, expert, slot, e, c)?;
        check_gate(OP, ctx.node, gate, buf, &r)?;
        if dy.dims() != [r.n, d] || dy.dtype() != buf.dtype() {
            return Err(format!(
                "{OP} `{}`: dy {}{} must be [{}, {d}] of buf's dtype {}",
                ctx.node,
                dy.dtype(),
                dy.shape(),
                r.n,
                buf.dtype()
            )
            .into());
        }
        let outs = dispatch_real!(buf.dtype(), combine_grad_typed(dy, buf, &r, gate))?;
        for (i, t) in outs.into_iter().enumerate() {
            ctx.set_output(i, t)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// MoeAuxLoss and MoeAuxLossGrad
// ---------------------------------------------------------------------------------------------

fn alpha_attr() -> AttrDef {
    attr_or(
        "alpha",
        AttrType::Float,
        AttrDefault::Float(DEFAULT_AUX_LOSS_COEF),
    )
}

fn moe_aux_loss() -> OpDef {
    OpDef::new(
        "MoeAuxLoss",
        "The Switch Transformer load-balancing loss alpha * E * sum_i f_i * P_i: f_i the \
         fraction of tokens whose first choice (expert[:, 0]) is i, P_i the mean of probs[:, i]. \
         In: probs [N, E] (f32 or f64), expert (i64 [N, k], MoeRoute's output 0). Out: loss [] \
         (probs' dtype; 0 for N = 0). Attrs: alpha (float, default 0.01).",
        |ctx| {
            const OP: &str = "MoeAuxLoss";
            check_alpha(OP, ctx.float("alpha")?)?;
            let (probs, expert) = (ctx.input(0)?, ctx.input(1)?);
            require_float(&format!("{OP}: probs"), probs)?;
            aux_infer(OP, probs, expert)?;
            Ok(vec![TensorType::new(probs.dtype, Shape::known(&[]))])
        },
    )
    .inputs([arg("probs"), arg("expert")])
    .outputs([arg("loss")])
    .attrs([alpha_attr()])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(AuxLossKernel {
            alpha: check_alpha("MoeAuxLoss", attr_float(init, "alpha")?)?,
        }))
    })
}

fn aux_infer(op: &str, probs: &TensorType, expert: &TensorType) -> Result<(), String> {
    let (pn, _) = rank2(op, "probs", probs, None)?;
    let (en, _) = rank2(op, "expert", expert, Some(DType::I64))?;
    same_dim(op, "probs and expert differ in N", pn, en)?;
    Ok(())
}

/// Run-time check; returns (N, E, f) with f the first-choice fractions.
fn aux_fractions(
    op: &str,
    node: &str,
    probs: &Tensor,
    expert: &Tensor,
) -> Result<(usize, usize, Vec<f64>), String> {
    let ok = match (probs.dims(), expert.dims()) {
        ([n, _], [en, k]) => n == en && *k >= 1,
        _ => false,
    };
    if !ok || expert.dtype() != DType::I64 {
        return Err(format!(
            "{op} `{node}`: probs {} must be [N, E] and expert {}{} i64 [N, k]",
            probs.shape(),
            expert.dtype(),
            expert.shape()
        ));
    }
    let (n, e, k) = (probs.dims()[0], probs.dims()[1], expert.dims()[1]);
    let ex = slice::<i64>(expert)?;
    let mut f = vec![0f64; e];
    for t in 0..n {
        let x = ex[t * k];
        if x < 0 || x as usize >= e {
            return Err(format!(
                "{op} `{node}`: expert {x} of token {t} is out of range [0, {e})"
            ));
        }
        f[x as usize] += 1.0;
    }
    if n > 0 {
        for v in &mut f {
            *v /= n as f64;
        }
    }
    Ok((n, e, f))
}

#[derive(Debug)]
struct AuxLossKernel {
    alpha: f64,
}

fn aux_loss_typed<T: Real>(probs: &Tensor, f: &[f64], alpha: f64) -> Result<Tensor, String> {
    let (n, e) = (probs.dims()[0], probs.dims()[1]);
    let ps = slice::<T>(probs)?;
    let mut p = vec![0f64; e];
    for row in ps.chunks(e.max(1)).take(n) {
        for (a, &v) in p.iter_mut().zip(row) {
            *a += v.to_f64();
        }
    }
    let sum: f64 = if n == 0 {
        0.0
    } else {
        f.iter().zip(&p).map(|(f, p)| f * (p / n as f64)).sum()
    };
    Ok(Tensor::scalar(T::from_f64(alpha * e as f64 * sum)))
}

impl Kernel for AuxLossKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (probs, expert) = (ctx.input(0)?, ctx.input(1)?);
        let (_, _, f) = aux_fractions("MoeAuxLoss", ctx.node, probs, expert)?;
        let loss = dispatch_real!(probs.dtype(), aux_loss_typed(probs, &f, self.alpha))?;
        ctx.set_output(0, loss)
    }
}

fn moe_aux_loss_grad() -> OpDef {
    OpDef::new(
        "MoeAuxLossGrad",
        "The gradient of MoeAuxLoss w.r.t. probs: dprobs[n, i] = dloss * alpha * E * f_i / N. \
         In: dloss [] (probs' dtype), probs [N, E], expert (i64 [N, k]). Out: dprobs [N, E]. \
         Attrs: alpha (float, default 0.01; MoeAuxLoss's).",
        |ctx| {
            const OP: &str = "MoeAuxLossGrad";
            check_alpha(OP, ctx.float("alpha")?)?;
            let (dloss, probs, expert) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_float(&format!("{OP}: probs"), probs)?;
            if dloss.dtype != probs.dtype || dloss.shape.rank().is_some_and(|r| r != 0) {
                return Err(format!(
                    "{OP}: dloss must be a scalar of probs' dtype {}, got {dloss}",
                    probs.dtype
                )
                .into());
            }
            aux_infer(OP, probs, expert)?;
            Ok(vec![probs.clone()])
        },
    )
    .inputs([arg("dloss"), arg("probs"), arg("expert")])
    .outputs([arg("dprobs")])
    .attrs([alpha_attr()])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(AuxLossGradKernel {
            alpha: check_alpha("MoeAuxLossGrad", attr_float(init, "alpha")?)?,
        }))
    })
}

#[derive(Debug)]
struct AuxLossGradKernel {
    alpha: f64,
}

fn aux_grad_typed<T: Real>(
    dloss: &Tensor,
    n: usize,
    e: usize,
    f: &[f64],
    alpha: f64,
) -> Result<Tensor, String> {
    let d = slice::<T>(dloss)?
        .first()
        .map(|v| v.to_f64())
        .ok_or("MoeAuxLossGrad: dloss is empty")?;
    let scale = if n == 0 {
        0.0
    } else {
        d * alpha * e as f64 / n as f64
    };
    let row: Vec<f64> = f.iter().map(|f| scale * f).collect();
    let all: Vec<f64> = (0..n).flat_map(|_| row.iter().copied()).collect();
    f64_out::<T>(&[n, e], &all)
}

impl Kernel for AuxLossGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "MoeAuxLossGrad";
        let (dloss, probs, expert) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        if dloss.num_elements() != 1 || dloss.dtype() != probs.dtype() {
            return Err(format!(
                "{OP} `{}`: dloss {}{} must be one value of probs' dtype {}",
                ctx.node,
                dloss.dtype(),
                dloss.shape(),
                probs.dtype()
            )
            .into());
        }
        let (n, e, f) = aux_fractions(OP, ctx.node, probs, expert)?;
        let out = dispatch_real!(probs.dtype(), aux_grad_typed(dloss, n, e, &f, self.alpha))?;
        ctx.set_output(0, out)
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`] and the module docs).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        // The *Grad ops get none: second derivatives are not supported.
        r.set_gradient("MoeRoute", route_grad);
        r.set_gradient("MoeDispatch", dispatch_grad);
        r.set_gradient("MoeCombine", combine_grad);
        r.set_gradient("MoeAuxLoss", aux_loss_grad);
    }

    /// Only the gate output (2) is differentiable; expert, slot, dropped and load are integers.
    fn route_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let Some(Some(dgate)) = dys.get(2) else {
            return Ok(vec![None]);
        };
        let dprobs = b.op(
            "MoeRouteGrad",
            "dprobs",
            &[dgate, f.input(0)?, &f.output(0)],
            &[],
        );
        Ok(vec![Some(dprobs)])
    }

    fn dispatch_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dbuf = only_dy(dys)?;
        let dx = b.op(
            "MoeDispatchGrad",
            "dx",
            &[dbuf, f.input(1)?, f.input(2)?],
            &[],
        );
        Ok(vec![Some(dx), None, None])
    }

    fn combine_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let node = b.add(
            "MoeCombineGrad",
            "grad",
            &[dy, f.input(0)?, f.input(1)?, f.input(2)?, f.input(3)?],
            &[],
        );
        let out = |index| Output {
            node: node.clone(),
            index,
        };
        Ok(vec![Some(out(0)), None, None, Some(out(1))])
    }

    fn aux_loss_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dloss = only_dy(dys)?;
        let dprobs = b.op(
            "MoeAuxLossGrad",
            "dprobs",
            &[dloss, f.input(0)?, f.input(1)?],
            &[("alpha", f.attr("alpha")?.clone())],
        );
        Ok(vec![Some(dprobs), None])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_ceiling_capped_at_the_token_count() {
        assert_eq!(capacity(8, 4, 1.0), 2);
        assert_eq!(capacity(10, 4, 1.0), 3);
        assert_eq!(capacity(8, 4, 1.25), 3);
        assert_eq!(capacity(8, 4, 1e300), 8);
        assert_eq!(capacity(0, 4, 1.0), 0);
        assert_eq!(capacity(8, 0, 1.0), 0);
    }

    #[test]
    fn top_k_breaks_ties_to_the_lower_index_and_skips_nan() {
        assert_eq!(top_k(&[0.25; 4], 2), [0, 1]);
        assert_eq!(top_k(&[0.1, 0.5, 0.4], 2), [1, 2]);
        assert_eq!(top_k(&[f64::NAN, 0.5, 0.4], 2), [1, 2]);
        assert_eq!(top_k(&[0.1, 0.5], 1)[0], 1);
    }
}
