//! The dflow DSL: a small text language for graphs, with the same expressive power as JSON.
//!
//! ```text
//! # 64-32-10 MLP
//! dflow 1
//! device "/job:ps/task:0" {
//!   w1 = Variable(dtype: f32, shape: [64, 32], initializer: "glorot_uniform", seed: 1)
//! }
//! x = Placeholder(dtype: f32, shape: [-1, 64])
//! h = Identity(x) @ "/job:worker/task:0"
//! sink = NoOp(^h) colocate(w1)
//! c = Const(value: tensor(f32, [2], [1.0, 2.0]))
//! train { loss: h, optimizer: adam(lr: 0.01), clip_global_norm: 5.0, metrics: [h] }
//! ```
//!
//! Grammar (whitespace and `# comments` may appear between any two tokens):
//!
//! ```text
//! file    := "dflow" INT stmt*
//! stmt    := node | "device" STRING "{" node* "}" | train
//! train   := "train" "{" [field ("," field)* [","]] "}"     (at most once)
//! field   := "loss" ":" TENSOR | "metrics" ":" "[" [TENSOR ("," TENSOR)* [","]] "]"
//!          | "optimizer" ":" IDENT "(" [IDENT ":" value ("," IDENT ":" value)* [","]] ")"
//!          | "clip_global_norm" ":" value
//! TENSOR  := NAME [":" DIGITS] | STRING
//! node    := NAME "=" IDENT "(" [arg ("," arg)* [","]] ")" suffix*
//! arg     := input | IDENT ":" value          (inputs first, then attrs)
//! input   := ["^"] NAME [":" DIGITS]           (no spaces inside an input)
//! suffix  := "@" STRING | "colocate" "(" NAME ("," NAME)* [","] ")"
//! value   := INT | FLOAT | "nan" | "inf" | "-inf" | "true" | "false" | "null" | STRING
//!          | IDENT (a bare word is a string: `dtype: f32`)
//!          | "[" [value ("," value)* [","]] "]"
//!          | "tensor" "(" IDENT "," value "," value ")"   (dtype, shape, values)
//! NAME    := [A-Za-z0-9_./-]+                  (checked by `check_node_name`)
//! ```
//!
//! A node inside a `device` block gets the block's device; `@` inside a block and nested blocks
//! are errors, so every node's device is written in exactly one place.

use super::{
    attr_to_json, build_graph, At, Errors, FormatErrors, ParsedGraph, RawNode, Source,
    SUPPORTED_VERSIONS,
};
use crate::def::FORMAT_VERSION;
use crate::train::SpecField;
use crate::GraphDef;
use serde_json::{Number, Value};
use std::fmt::Write as _;
use winnow::combinator::{alt, opt, peek, preceded, repeat};
use winnow::error::ModalResult;
use winnow::error::{AddContext, ContextError, ErrMode, StrContext, StrContextValue};
use winnow::stream::{LocatingSlice, Location, Stream};
use winnow::token::{any, literal, one_of, take_till, take_while};
use winnow::Parser;

/// Lists nest at most this deep.
pub const MAX_DEPTH: usize = 64;

type Input<'a> = LocatingSlice<&'a str>;

/// A syntax error with its own position and message (carried as the winnow error's cause).
#[derive(Debug)]
struct Msg {
    pos: usize,
    msg: String,
}

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Msg {}

#[allow(deprecated)] // ErrorKind is the only way to attach a cause in winnow 0.6
fn fail<T>(pos: usize, msg: String) -> ModalResult<T> {
    let e = winnow::error::FromExternalError::<Input<'_>, Msg>::from_external_error(
        &LocatingSlice::new(""),
        winnow::error::ErrorKind::Verify,
        Msg { pos, msg },
    );
    Err(ErrMode::Cut(e))
}

/// A committed error saying which tokens were expected at the current position.
fn expected<T>(i: &Input<'_>, what: &[&'static str]) -> ModalResult<T> {
    let mut e = ContextError::new();
    for w in what {
        e = e.add_context(
            i,
            &i.checkpoint(),
            StrContext::Expected(StrContextValue::StringLiteral(w)),
        );
    }
    Err(ErrMode::Cut(e))
}

/// Skips whitespace and comments.
fn ws(i: &mut Input<'_>) -> ModalResult<()> {
    repeat(
        0..,
        alt((
            take_while(1.., (' ', '\t', '\r', '\n')).void(),
            ('#', take_till(0.., '\n')).void(),
        )),
    )
    .parse_next(i)
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn ident<'a>(i: &mut Input<'a>) -> ModalResult<&'a str> {
    (
        one_of(is_ident_start),
        take_while(0.., |c: char| c.is_ascii_alphanumeric() || c == '_'),
    )
        .take()
        .parse_next(i)
}

fn name<'a>(i: &mut Input<'a>) -> ModalResult<At<String>> {
    let pos = i.location();
    take_while(1.., is_name_char)
        .map(|s: &str| At {
            v: s.to_string(),
            pos,
        })
        .parse_next(i)
}

/// A token that must come next (after whitespace); a committed error otherwise.
fn token(i: &mut Input<'_>, t: &'static str) -> ModalResult<()> {
    ws(i)?;
    if literal::<_, _, ContextError>(t).parse_next(i).is_err() {
        return expected(i, &[t]);
    }
    Ok(())
}

/// True (and consumed) when `t` comes next after whitespace.
fn eat(i: &mut Input<'_>, t: &'static str) -> ModalResult<bool> {
    ws(i)?;
    Ok(opt(literal(t)).parse_next(i)?.is_some())
}

fn string(i: &mut Input<'_>) -> ModalResult<String> {
    let start = i.location();
    '"'.parse_next(i)?;
    let mut out = String::new();
    loop {
        let run: &str = take_till(0.., ('"', '\\', '\n')).parse_next(i)?;
        out.push_str(run);
        match opt(any).parse_next(i)? {
            Some('"') => return Ok(out),
            Some('\\') => {
                let at = i.location() - 1;
                let c = match opt(any).parse_next(i)? {
                    Some('"') => '"',
                    Some('\\') => '\\',
                    Some('n') => '\n',
                    Some('t') => '\t',
                    Some('r') => '\r',
                    Some('0') => '\0',
                    Some('u') => {
                        let hex: Option<&str> = opt(preceded(
                            '{',
                            take_while(1..=6, |c: char| c.is_ascii_hexdigit()),
                        ))
                        .parse_next(i)?;
                        let close = opt('}').parse_next(i)?;
                        match (hex, close) {
                            (Some(h), Some(_)) => match u32::from_str_radix(h, 16)
                                .ok()
                                .and_then(char::from_u32)
                            {
                                Some(c) => c,
                                None => return fail(at, format!("invalid code point \\u{{{h}}}")),
                            },
                            _ => return fail(at, "expected \\u{HEX} (1 to 6 hex digits)".into()),
                        }
                    }
                    Some(c) => return fail(at, format!("unknown escape \\{c}")),
                    None => return fail(start, "unterminated string".into()),
                };
                out.push(c);
            }
            _ => {
                return fail(
                    start,
                    "unterminated string (strings end on the same line)".into(),
                )
            }
        }
    }
}

fn number(i: &mut Input<'_>) -> ModalResult<Value> {
    let pos = i.location();
    let text: &str = (
        opt('-'),
        take_while(1.., |c: char| c.is_ascii_digit()),
        opt(('.', take_while(1.., |c: char| c.is_ascii_digit()))),
        opt((
            one_of(['e', 'E']),
            opt(one_of(['+', '-'])),
            take_while(1.., |c: char| c.is_ascii_digit()),
        )),
    )
        .take()
        .parse_next(i)?;
    if !text.contains(['.', 'e', 'E']) {
        return match text.parse::<i64>() {
            Ok(n) => Ok(Value::from(n)),
            Err(_) => fail(
                pos,
                format!("integer {text} does not fit in 64 bits (signed)"),
            ),
        };
    }
    match text.parse::<f64>().ok().and_then(Number::from_f64) {
        Some(n) => Ok(Value::Number(n)),
        None => fail(
            pos,
            format!("number {text} is out of range for f64 (write inf or -inf)"),
        ),
    }
}

fn value(i: &mut Input<'_>, depth: usize) -> ModalResult<Value> {
    ws(i)?;
    let pos = i.location();
    let next = peek(opt(any)).parse_next(i)?;
    match next {
        Some('[') => {
            if depth >= MAX_DEPTH {
                return fail(pos, format!("lists nest deeper than {MAX_DEPTH} levels"));
            }
            '['.parse_next(i)?;
            let mut items = vec![];
            loop {
                if eat(i, "]")? {
                    return Ok(Value::Array(items));
                }
                items.push(value(i, depth + 1)?);
                ws(i)?;
                if eat(i, ",")? {
                    continue;
                }
                if eat(i, "]")? {
                    return Ok(Value::Array(items));
                }
                return expected(i, &["]", ","]);
            }
        }
        Some('"') => Ok(Value::String(string(i)?)),
        Some('-') if i.starts_with("-inf") => {
            literal("-inf").parse_next(i)?;
            Ok(Value::String("-inf".into()))
        }
        Some('-' | '0'..='9') => number(i),
        Some(c) if is_ident_start(c) => {
            let w = ident(i)?;
            Ok(match w {
                "true" => Value::Bool(true),
                "false" => Value::Bool(false),
                "null" => Value::Null,
                "nan" | "inf" => Value::String(w.into()),
                "tensor" => {
                    token(i, "(")?;
                    ws(i)?;
                    let dt = match opt(ident).parse_next(i)? {
                        Some(d) => d.to_string(),
                        None => return expected(i, &["dtype"]),
                    };
                    token(i, ",")?;
                    let shape = value(i, depth + 1)?;
                    token(i, ",")?;
                    let values = value(i, depth + 1)?;
                    token(i, ")")?;
                    let mut m = serde_json::Map::new();
                    m.insert("dtype".into(), Value::String(dt));
                    m.insert("shape".into(), shape);
                    m.insert("values".into(), values);
                    Value::Object(m)
                }
                other => Value::String(other.into()),
            })
        }
        _ => expected(i, &["value"]),
    }
}

/// Parses one node statement; `block` is the enclosing device block's device, if any.
fn node(
    i: &mut Input<'_>,
    block: Option<&str>,
    soft: &mut Vec<(usize, String)>,
) -> ModalResult<RawNode> {
    ws(i)?;
    let Some(n) = opt(name).parse_next(i)? else {
        return expected(i, &["node name"]);
    };
    let mut raw = RawNode {
        pos: n.pos,
        name: Some(n),
        device: block.unwrap_or_default().to_string(),
        ..RawNode::default()
    };
    token(i, "=")?;
    ws(i)?;
    let op_pos = i.location();
    let Some(op) = opt(ident).parse_next(i)? else {
        return expected(i, &["op name"]);
    };
    raw.op = Some(At {
        v: op.to_string(),
        pos: op_pos,
    });
    token(i, "(")?;
    loop {
        if eat(i, ")")? {
            break;
        }
        arg(i, &mut raw, soft)?;
        if eat(i, ",")? {
            continue;
        }
        if eat(i, ")")? {
            break;
        }
        return expected(i, &[")", ","]);
    }
    let mut device_set = false;
    loop {
        ws(i)?;
        let pos = i.location();
        if eat(i, "@")? {
            ws(i)?;
            if !i.starts_with('"') {
                return expected(i, &["device string"]);
            }
            let d = string(i)?;
            if block.is_some() {
                soft.push((
                    pos,
                    "a node inside a device block cannot also have `@ \"device\"` \
                     (the block sets it)"
                        .into(),
                ));
            } else if device_set {
                soft.push((pos, "node has two `@` devices".into()));
            }
            device_set = true;
            raw.device = d;
        } else if i.starts_with("colocate")
            && peek(opt((literal("colocate"), ws, '(')))
                .parse_next(i)?
                .is_some()
        {
            literal("colocate").parse_next(i)?;
            token(i, "(")?;
            loop {
                ws(i)?;
                let Some(c) = opt(name).parse_next(i)? else {
                    return expected(i, &["node name"]);
                };
                raw.colocate_with.push(c);
                if eat(i, ",")? {
                    if eat(i, ")")? {
                        break;
                    }
                    continue;
                }
                if eat(i, ")")? {
                    break;
                }
                return expected(i, &[")", ","]);
            }
        } else {
            return Ok(raw);
        }
    }
}

fn arg(i: &mut Input<'_>, raw: &mut RawNode, soft: &mut Vec<(usize, String)>) -> ModalResult<()> {
    ws(i)?;
    let pos = i.location();
    if opt('^').parse_next(i)?.is_some() {
        let Some(n) = opt(name).parse_next(i)? else {
            return expected(i, &["node name after ^"]);
        };
        return push_input(raw, format!("^{}", n.v), pos, soft);
    }
    let Some(n) = opt(name).parse_next(i)? else {
        return expected(i, &["input", "attr", ")"]);
    };
    // `x:1` (no spaces) is output 1 of x; `key: value` is an attr.
    if let Some(idx) =
        opt(preceded(':', take_while(1.., |c: char| c.is_ascii_digit()))).parse_next(i)?
    {
        return push_input(raw, format!("{}:{idx}", n.v), pos, soft);
    }
    if eat(i, ":")? {
        if !n.v.starts_with(is_ident_start)
            || !n.v.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return fail(pos, format!("attr name {:?} is not an identifier", n.v));
        }
        ws(i)?;
        let vpos = i.location();
        let v = value(i, 0)?;
        raw.attrs.push((n, At { v, pos: vpos }));
        return Ok(());
    }
    push_input(raw, n.v, pos, soft)
}

fn push_input(
    raw: &mut RawNode,
    input: String,
    pos: usize,
    soft: &mut Vec<(usize, String)>,
) -> ModalResult<()> {
    if !raw.attrs.is_empty() {
        soft.push((
            pos,
            format!(
                "input {input:?} comes after attrs; inputs come first \
                 (for an attr write `key: value`)"
            ),
        ));
    }
    raw.inputs.push(At { v: input, pos });
    Ok(())
}

fn header(i: &mut Input<'_>) -> ModalResult<()> {
    ws(i)?;
    if opt(literal("dflow")).parse_next(i)?.is_none() {
        return expected(i, &["dflow 1"]);
    }
    ws(i)?;
    let pos = i.location();
    let Some(v) = opt(take_while(1.., |c: char| c.is_ascii_digit())).parse_next(i)? else {
        return expected(i, &["version number"]);
    };
    if v.parse::<u32>().ok() != Some(FORMAT_VERSION) {
        let supported: Vec<_> = SUPPORTED_VERSIONS.iter().map(u32::to_string).collect();
        return fail(
            pos,
            format!(
                "unsupported format version {v} (this build reads version {})",
                supported.join(", ")
            ),
        );
    }
    Ok(())
}

/// Parses all statements; stops at the first syntax error.
fn file(
    i: &mut Input<'_>,
    nodes: &mut Vec<RawNode>,
    train: &mut Option<(usize, Vec<SpecField>)>,
    soft: &mut Vec<(usize, String)>,
) -> ModalResult<()> {
    header(i)?;
    loop {
        ws(i)?;
        if i.is_empty() {
            return Ok(());
        }
        let pos = i.location();
        if peek(opt((literal("train"), ws, '{')))
            .parse_next(i)?
            .is_some()
        {
            let section = train_block(i)?;
            if train.is_some() {
                soft.push((pos, "a second train section (only one is allowed)".into()));
            } else {
                *train = Some(section);
            }
            continue;
        }
        let block = peek(opt((literal("device"), ws, '"'))).parse_next(i)?;
        if block.is_none() {
            nodes.push(node(i, None, soft)?);
            continue;
        }
        literal("device").parse_next(i)?;
        ws(i)?;
        let dev = string(i)?;
        token(i, "{")?;
        loop {
            if eat(i, "}")? {
                break;
            }
            ws(i)?;
            if i.is_empty() {
                return fail(pos, "device block is never closed (missing \"}\")".into());
            }
            if peek(opt((literal("device"), ws, '"')))
                .parse_next(i)?
                .is_some()
            {
                return fail(i.location(), "device blocks cannot be nested".into());
            }
            nodes.push(node(i, Some(&dev), soft)?);
        }
    }
}

/// A tensor name: `NAME[:DIGITS]` or a quoted string.
fn tensor_ref(i: &mut Input<'_>) -> ModalResult<Value> {
    ws(i)?;
    if peek(opt('"')).parse_next(i)?.is_some() {
        return Ok(Value::String(string(i)?));
    }
    let Some(n) = opt(name).parse_next(i)? else {
        return expected(i, &["tensor name"]);
    };
    let mut v = n.v;
    if opt(':').parse_next(i)?.is_some() {
        let Some(d) = opt(take_while(1.., |c: char| c.is_ascii_digit())).parse_next(i)? else {
            return expected(i, &["output index"]);
        };
        v = format!("{v}:{d}");
    }
    Ok(Value::String(v))
}

/// `IDENT(key: value, ...)` as `{"type": IDENT, key: value, ...}`.
fn optimizer(i: &mut Input<'_>) -> ModalResult<Value> {
    ws(i)?;
    let Some(kind) = opt(ident).parse_next(i)? else {
        return expected(i, &["optimizer (sgd, momentum, adam)"]);
    };
    let mut m = serde_json::Map::new();
    m.insert("type".into(), Value::String(kind.into()));
    token(i, "(")?;
    loop {
        if eat(i, ")")? {
            return Ok(Value::Object(m));
        }
        ws(i)?;
        let Some(k) = opt(ident).parse_next(i)? else {
            return expected(i, &["optimizer parameter", ")"]);
        };
        token(i, ":")?;
        let v = value(i, 0)?;
        m.insert(k.into(), v);
        if eat(i, ",")? {
            continue;
        }
        if eat(i, ")")? {
            return Ok(Value::Object(m));
        }
        return expected(i, &[")", ","]);
    }
}

/// `train { field: value, ... }`: the fields with their values' offsets.
fn train_block(i: &mut Input<'_>) -> ModalResult<(usize, Vec<SpecField>)> {
    let pos = i.location();
    literal("train").parse_next(i)?;
    token(i, "{")?;
    let mut fields = vec![];
    loop {
        if eat(i, "}")? {
            return Ok((pos, fields));
        }
        ws(i)?;
        let Some(k) = opt(ident).parse_next(i)? else {
            return expected(
                i,
                &["train field (loss, optimizer, clip_global_norm, metrics, lr_schedule, data)"],
            );
        };
        token(i, ":")?;
        ws(i)?;
        let at = i.location();
        let v = match k {
            "loss" => tensor_ref(i)?,
            "optimizer" | "lr_schedule" | "data" => optimizer(i)?,
            "metrics" => {
                token(i, "[")?;
                let mut items = vec![];
                loop {
                    if eat(i, "]")? {
                        break;
                    }
                    items.push(tensor_ref(i)?);
                    if eat(i, ",")? {
                        continue;
                    }
                    if eat(i, "]")? {
                        break;
                    }
                    return expected(i, &["]", ","]);
                }
                Value::Array(items)
            }
            _ => value(i, 0)?,
        };
        fields.push((k.to_string(), at, v));
        if eat(i, ",")? {
            continue;
        }
        if eat(i, "}")? {
            return Ok((pos, fields));
        }
        return expected(i, &["}", ","]);
    }
}

/// Parses a DSL graph file. `path` is only used in messages.
///
/// A syntax error stops the parse; semantic errors of the nodes before it (unknown op or attr,
/// bad attr value, bad input or name) are reported with it, up to [`super::MAX_ERRORS`].
pub fn parse_dsl(text: &str, path: Option<&str>) -> Result<ParsedGraph, FormatErrors> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let src = Source::new(text, path);
    let mut errs = Errors::new(&src);
    let mut input = LocatingSlice::new(text);
    let mut nodes = vec![];
    let mut train = None;
    let mut soft = vec![];
    let syntax = file(&mut input, &mut nodes, &mut train, &mut soft)
        .err()
        .map(|e| {
            let at = input.location();
            syntax_message(e, at, text)
        });
    for (p, m) in soft {
        errs.push(p, m);
    }
    let mut g = build_graph(nodes, &mut errs);
    if let Some((pos, fields)) = train {
        match crate::train::spec_from_fields(fields, pos) {
            Ok(spec) => g.def.train = Some(spec),
            Err(list) => list.into_iter().for_each(|(p, m)| errs.push(p, m)),
        }
    }
    if let Some((p, m)) = syntax {
        errs.push(p, m);
    }
    errs.into_result(g)
}

fn syntax_message(e: ErrMode<ContextError>, at: usize, text: &str) -> (usize, String) {
    let e = match e {
        ErrMode::Backtrack(e) | ErrMode::Cut(e) => e,
        ErrMode::Incomplete(_) => return (at, "unexpected end of file".into()),
    };
    if let Some(m) = e.cause().and_then(|c| c.downcast_ref::<Msg>()) {
        return (m.pos, m.msg.clone());
    }
    let wanted: Vec<String> = e
        .context()
        .filter_map(|c| match c {
            StrContext::Expected(StrContextValue::StringLiteral(s)) if s.contains(' ') => {
                Some(s.to_string())
            }
            StrContext::Expected(StrContextValue::StringLiteral(s)) => {
                Some(if ["value", "input", "attr"].contains(s) {
                    s.to_string()
                } else {
                    format!("{s:?}")
                })
            }
            StrContext::Expected(v) => Some(v.to_string()),
            StrContext::Label(l) => Some(l.to_string()),
            _ => None,
        })
        .collect();
    let found = match text.get(at..).and_then(|t| t.chars().next()) {
        None => "end of file".to_string(),
        Some(c) => format!("{c:?}"),
    };
    if wanted.is_empty() {
        (at, format!("syntax error at {found}"))
    } else {
        (
            at,
            format!("expected {}, found {found}", wanted.join(" or ")),
        )
    }
}

/// Writes a graph in the DSL: a header, then one line per node, attrs sorted by name. Every
/// node's device is written with `@`. Always writes the current format version.
pub fn to_dsl(def: &GraphDef) -> String {
    let mut out = String::with_capacity(16 + def.nodes.len() * 48);
    let _ = writeln!(out, "dflow {FORMAT_VERSION}");
    for n in &def.nodes {
        let _ = write!(out, "{} = {}(", n.name, n.op);
        let mut first = true;
        for inp in &n.inputs {
            if !first {
                out.push_str(", ");
            }
            first = false;
            out.push_str(inp);
        }
        for (k, v) in &n.attrs {
            if !first {
                out.push_str(", ");
            }
            first = false;
            let _ = write!(out, "{k}: ");
            write_value(&mut out, &attr_to_json(v));
        }
        out.push(')');
        if !n.device.is_empty() {
            out.push_str(" @ ");
            write_string(&mut out, &n.device);
        }
        if !n.colocate_with.is_empty() {
            let _ = write!(out, " colocate({})", n.colocate_with.join(", "));
        }
        out.push('\n');
    }
    if let Some(t) = &def.train {
        write_train(&mut out, t);
    }
    out
}

/// `train { loss: ..., optimizer: adam(lr: ..., ...), clip_global_norm: ..., metrics: [...] }`
fn write_train(out: &mut String, t: &crate::train::TrainSpec) {
    let tensor = |out: &mut String, s: &str| {
        if matches!(crate::InputRef::parse(s), Ok(crate::InputRef::Data { .. })) {
            out.push_str(s);
        } else {
            write_string(out, s);
        }
    };
    out.push_str("train { loss: ");
    tensor(out, &t.loss);
    let _ = write!(out, ", optimizer: {}(lr: ", t.optimizer.kind.name());
    write_value(out, &Value::from(t.optimizer.lr));
    for (k, v) in t.optimizer.kind.params() {
        let _ = write!(out, ", {k}: ");
        write_value(out, &attr_to_json(&v));
    }
    out.push(')');
    if let Some(c) = t.clip_global_norm {
        out.push_str(", clip_global_norm: ");
        write_value(out, &Value::from(c));
    }
    if !t.metrics.is_empty() {
        out.push_str(", metrics: [");
        for (i, m) in t.metrics.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            tensor(out, m);
        }
        out.push(']');
    }
    if let Some(schedule) = &t.lr_schedule {
        out.push_str(", lr_schedule: ");
        write_call(out, &crate::train::schedule_to_json(schedule));
    }
    if let Some(data) = &t.data {
        out.push_str(", data: ");
        write_call(out, &crate::train::data_to_json(data));
    }
    out.push_str(" }\n");
}

/// `{"type": NAME, k: v, ...}` as `NAME(k: v, ...)` (the form `optimizer` parses).
fn write_call(out: &mut String, v: &Value) {
    let Some(obj) = v.as_object() else {
        return write_value(out, v);
    };
    let name = obj.get("type").and_then(Value::as_str).unwrap_or_default();
    let _ = write!(out, "{name}(");
    for (i, (k, v)) in obj.iter().filter(|(k, _)| *k != "type").enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{k}: ");
        write_value(out, v);
    }
    out.push(')');
}

fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

const WORDS: &[&str] = &["true", "false", "null", "nan", "inf", "tensor"];

fn write_value(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) if !n.is_f64() => {
                let _ = write!(out, "{i}");
            }
            (_, Some(x)) => {
                let _ = write!(out, "{x:?}");
            }
            _ => {
                let _ = write!(out, "{n}");
            }
        },
        Value::String(s) => {
            // Non-finite floats travel as these strings; bare words stay readable (`f32`).
            let bare = matches!(s.as_str(), "nan" | "inf" | "-inf")
                || (s.starts_with(is_ident_start)
                    && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && !WORDS.contains(&s.as_str()));
            if bare {
                out.push_str(s);
            } else {
                write_string(out, s);
            }
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(out, x);
            }
            out.push(']');
        }
        Value::Object(o) => {
            // Only tensors are objects: tensor(dtype, shape, values).
            out.push_str("tensor(");
            let dtype = o.get("dtype").and_then(Value::as_str).unwrap_or("f32");
            out.push_str(dtype);
            out.push_str(", ");
            write_value(out, o.get("shape").unwrap_or(&Value::Array(vec![])));
            out.push_str(", ");
            write_value(out, o.get("values").unwrap_or(&Value::Array(vec![])));
            out.push(')');
        }
    }
}
