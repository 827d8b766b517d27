//! The JSON graph format.
//!
//! ```json
//! {"format": "dflow-graph", "version": 1, "nodes": [
//!   {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [-1, 64]}},
//!   {"name": "y", "op": "Identity", "inputs": ["x"], "device": "/job:worker/task:0"}
//! ]}
//! ```
//!
//! The reader is a small recursive-descent parser of its own rather than serde_json: every
//! semantic error (unknown op, bad attr, bad input) must point at a line and column, and
//! serde_json's `Value` keeps no positions. Writing ~250 lines of JSON reader also gives us an
//! explicit nesting limit ([`MAX_DEPTH`]), duplicate-key errors and exact control over numbers,
//! without another dependency. Attribute values are handed to [`crate::AttrValue::from_json`] as
//! `serde_json::Value`s.

use super::{attr_to_json, build_graph, At, Errors, FormatErrors, ParsedGraph, RawNode, Source};
use crate::def::FORMAT_VERSION;
use crate::GraphDef;
use serde_json::{Map, Number, Value};
use std::borrow::Cow;
use std::fmt::Write as _;

/// Arrays and objects nest at most this deep.
pub const MAX_DEPTH: usize = 128;

/// The value of the top-level `"format"` field.
pub const FORMAT_TAG: &str = "dflow-graph";

/// A JSON value with the byte offset where it starts.
#[derive(Debug)]
struct Spanned<'a> {
    pos: usize,
    v: J<'a>,
}

#[derive(Debug)]
enum J<'a> {
    Null,
    Bool(bool),
    Num(Number),
    /// Borrowed from the input unless it had escapes.
    Str(Cow<'a, str>),
    Arr(Vec<Spanned<'a>>),
    /// Keys in file order, each with its offset.
    Obj(Vec<(At<Cow<'a, str>>, Spanned<'a>)>),
}

impl J<'_> {
    fn kind(&self) -> &'static str {
        match self {
            J::Null => "null",
            J::Bool(_) => "a bool",
            J::Num(_) => "a number",
            J::Str(_) => "a string",
            J::Arr(_) => "an array",
            J::Obj(_) => "an object",
        }
    }
}

impl Spanned<'_> {
    fn into_value(self) -> Value {
        match self.v {
            J::Null => Value::Null,
            J::Bool(b) => Value::Bool(b),
            J::Num(n) => Value::Number(n),
            J::Str(s) => Value::String(s.into_owned()),
            J::Arr(a) => Value::Array(a.into_iter().map(Spanned::into_value).collect()),
            J::Obj(o) => Value::Object(
                o.into_iter()
                    .map(|(k, v)| (k.v.into_owned(), v.into_value()))
                    .collect::<Map<_, _>>(),
            ),
        }
    }
}

/// A syntax error: offset and message.
type SynErr = (usize, String);

struct Reader<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl<'a> Reader<'a> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn found(&self) -> String {
        match self.text.get(self.i..).and_then(|t| t.chars().next()) {
            None => "end of file".into(),
            Some(c) => format!("{c:?}"),
        }
    }

    fn value(&mut self, depth: usize) -> Result<Spanned<'a>, SynErr> {
        self.ws();
        let pos = self.i;
        let v = match self.s.get(self.i) {
            None => return Err((pos, "expected a value, found end of file".into())),
            Some(b'{') | Some(b'[') if depth >= MAX_DEPTH => {
                return Err((pos, format!("nesting deeper than {MAX_DEPTH} levels")))
            }
            Some(b'{') => self.object(depth + 1)?,
            Some(b'[') => self.array(depth + 1)?,
            Some(b'"') => J::Str(self.string()?),
            Some(b't') => self.word("true", J::Bool(true))?,
            Some(b'f') => self.word("false", J::Bool(false))?,
            Some(b'n') => self.word("null", J::Null)?,
            Some(b'-' | b'0'..=b'9') => J::Num(self.number()?),
            Some(_) => {
                return Err((
                    pos,
                    format!("expected a JSON value, found {}", self.found()),
                ))
            }
        };
        Ok(Spanned { pos, v })
    }

    fn word(&mut self, w: &str, v: J<'a>) -> Result<J<'a>, SynErr> {
        if self.s[self.i..].starts_with(w.as_bytes()) {
            self.i += w.len();
            Ok(v)
        } else {
            let end = self.s[self.i..]
                .iter()
                .position(|b| !b.is_ascii_alphanumeric())
                .map_or(self.s.len(), |n| self.i + n);
            let got = String::from_utf8_lossy(&self.s[self.i..end]);
            Err((self.i, format!("expected a JSON value, found `{got}`")))
        }
    }

    fn number(&mut self) -> Result<Number, SynErr> {
        let start = self.i;
        let digits = |r: &mut Self| {
            let from = r.i;
            while r.s.get(r.i).is_some_and(u8::is_ascii_digit) {
                r.i += 1;
            }
            r.i - from
        };
        if self.s.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        let int_start = self.i;
        if digits(self) == 0 {
            return Err((self.i, format!("expected a digit, found {}", self.found())));
        }
        if self.s[int_start] == b'0' && self.i - int_start > 1 {
            return Err((int_start, "numbers may not have leading zeros".into()));
        }
        let mut is_float = false;
        if self.s.get(self.i) == Some(&b'.') {
            is_float = true;
            self.i += 1;
            if digits(self) == 0 {
                return Err((
                    self.i,
                    format!("expected a digit after '.', found {}", self.found()),
                ));
            }
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            is_float = true;
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if digits(self) == 0 {
                return Err((
                    self.i,
                    format!("expected an exponent, found {}", self.found()),
                ));
            }
        }
        let text = &self.text[start..self.i];
        if !is_float {
            return text.parse::<i64>().map(Number::from).map_err(|_| {
                (
                    start,
                    format!("integer {text} does not fit in 64 bits (signed)"),
                )
            });
        }
        text.parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .ok_or_else(|| (start, format!("number {text} is out of range for f64")))
    }

    fn string(&mut self) -> Result<Cow<'a, str>, SynErr> {
        let start = self.i;
        self.i += 1; // opening quote
                     // Most strings have no escapes: borrow them from the input.
        let run = self.i;
        while let Some(&b) = self.s.get(self.i) {
            if b == b'"' || b == b'\\' || b < 0x20 {
                break;
            }
            self.i += 1;
        }
        if self.s.get(self.i) == Some(&b'"') {
            let text: &'a str = self.text;
            self.i += 1;
            return Ok(Cow::Borrowed(&text[run..self.i - 1]));
        }
        self.i = run;
        let mut out = String::new();
        loop {
            let run = self.i;
            while let Some(&b) = self.s.get(self.i) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.i += 1;
            }
            out.push_str(&self.text[run..self.i]);
            match self.s.get(self.i) {
                None => return Err((start, "unterminated string".into())),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    let esc = self.i;
                    self.i += 1;
                    let c = match self.s.get(self.i) {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.i += 1;
                            let hi = self.hex4(esc)?;
                            let code = if (0xD800..0xDC00).contains(&hi) {
                                if !self.s[self.i..].starts_with(b"\\u") {
                                    return Err((esc, "unpaired surrogate in \\u escape".into()));
                                }
                                self.i += 2;
                                let lo = self.hex4(esc)?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err((esc, "unpaired surrogate in \\u escape".into()));
                                }
                                0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                hi
                            };
                            out.push(char::from_u32(code).ok_or_else(|| {
                                (esc, "invalid code point in \\u escape".to_string())
                            })?);
                            continue;
                        }
                        _ => return Err((esc, format!("invalid escape \\{}", self.after(1)))),
                    };
                    out.push(c);
                    self.i += 1;
                }
                Some(_) => {
                    return Err((
                        self.i,
                        "control character in string (escape it, e.g. \\n)".into(),
                    ))
                }
            }
        }
    }

    fn after(&self, n: usize) -> String {
        self.text
            .get(self.i..)
            .and_then(|t| t.chars().next())
            .map_or_else(|| "<end of file>".repeat(n.min(1)), |c| c.to_string())
    }

    fn hex4(&mut self, esc: usize) -> Result<u32, SynErr> {
        let h = self
            .text
            .get(self.i..self.i + 4)
            .and_then(|h| {
                u32::from_str_radix(h, 16)
                    .ok()
                    .filter(|_| !h.starts_with('+'))
            })
            .ok_or_else(|| (esc, "\\u must be followed by 4 hex digits".to_string()))?;
        self.i += 4;
        Ok(h)
    }

    fn expect(&mut self, b: u8, what: &str) -> Result<(), SynErr> {
        self.ws();
        if self.s.get(self.i) == Some(&b) {
            self.i += 1;
            Ok(())
        } else {
            Err((self.i, format!("expected {what}, found {}", self.found())))
        }
    }

    fn array(&mut self, depth: usize) -> Result<J<'a>, SynErr> {
        self.i += 1;
        let mut items = vec![];
        self.ws();
        if self.s.get(self.i) == Some(&b']') {
            self.i += 1;
            return Ok(J::Arr(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.ws();
            match self.s.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(J::Arr(items));
                }
                _ => {
                    return Err((
                        self.i,
                        format!("expected \",\" or \"]\", found {}", self.found()),
                    ))
                }
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<J<'a>, SynErr> {
        self.i += 1;
        let mut fields: Vec<(At<Cow<'a, str>>, Spanned<'a>)> = vec![];
        self.ws();
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
            return Ok(J::Obj(fields));
        }
        loop {
            self.ws();
            let kpos = self.i;
            if self.s.get(self.i) != Some(&b'"') {
                return Err((
                    self.i,
                    format!("expected a key in double quotes, found {}", self.found()),
                ));
            }
            let key = self.string()?;
            if fields.iter().any(|(k, _)| k.v == key) {
                return Err((kpos, format!("duplicate key {key:?}")));
            }
            self.expect(b':', "\":\"")?;
            let v = self.value(depth)?;
            fields.push((At { v: key, pos: kpos }, v));
            self.ws();
            match self.s.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(J::Obj(fields));
                }
                _ => {
                    return Err((
                        self.i,
                        format!("expected \",\" or \"}}\", found {}", self.found()),
                    ))
                }
            }
        }
    }
}

/// Parses a JSON graph file. `path` is only used in messages.
///
/// Syntax errors stop the parse; every node's semantic errors (unknown op or attr, bad attr
/// value, bad input or name) are reported together, up to [`super::MAX_ERRORS`].
pub fn parse_json(text: &str, path: Option<&str>) -> Result<ParsedGraph, FormatErrors> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let src = Source::new(text, path);
    let mut errs = Errors::new(&src);
    let mut r = Reader {
        s: text.as_bytes(),
        text,
        i: 0,
    };
    let root = r.value(0).and_then(|v| {
        r.ws();
        if r.i < r.s.len() {
            Err((
                r.i,
                format!("unexpected {} after the top-level value", r.found()),
            ))
        } else {
            Ok(v)
        }
    });
    let root = match root {
        Ok(v) => v,
        Err((pos, msg)) => {
            errs.push(pos, msg);
            return errs.into_result(ParsedGraph {
                def: GraphDef::default(),
                node_positions: vec![],
            });
        }
    };
    let mut train = None;
    let raw = top_level(root, &mut errs, &mut train);
    let mut g = build_graph(raw, &mut errs);
    g.def.train = train;
    errs.into_result(g)
}

fn top_level(
    root: Spanned<'_>,
    errs: &mut Errors<'_>,
    train: &mut Option<crate::train::TrainSpec>,
) -> Vec<RawNode> {
    let J::Obj(fields) = root.v else {
        errs.push(
            root.pos,
            format!("expected the graph object {{...}}, found {}", root.v.kind()),
        );
        return vec![];
    };
    let (mut format, mut version, mut nodes) = (None, None, None);
    for (k, v) in fields {
        match k.v.as_ref() {
            "format" => format = Some(v),
            "version" => version = Some(v),
            "nodes" => nodes = Some(v),
            "train" => *train = train_section(v, errs),
            other => errs.push(
                k.pos,
                format!(
                    "unknown field {other:?} (expected \"format\", \"version\", \"nodes\", \"train\")"
                ),
            ),
        }
    }
    match format {
        None => errs.push(
            root.pos,
            "missing field \"format\" (\"dflow-graph\")".into(),
        ),
        Some(Spanned { v: J::Str(s), .. }) if s == FORMAT_TAG => {}
        Some(f) => errs.push(f.pos, format!("\"format\" must be {FORMAT_TAG:?}")),
    }
    let supported = || {
        let v: Vec<_> = super::SUPPORTED_VERSIONS
            .iter()
            .map(u32::to_string)
            .collect();
        v.join(", ")
    };
    match version {
        None => errs.push(root.pos, "missing field \"version\"".into()),
        Some(Spanned { v: J::Num(n), .. }) if n.as_u64() == Some(FORMAT_VERSION.into()) => {}
        Some(v) => {
            let shown = match &v.v {
                J::Num(n) => n.to_string(),
                other => other.kind().to_string(),
            };
            errs.push(
                v.pos,
                format!(
                    "unsupported format version {shown} (this build reads version {})",
                    supported()
                ),
            );
        }
    }
    let Some(nodes) = nodes else {
        errs.push(root.pos, "missing field \"nodes\"".into());
        return vec![];
    };
    let J::Arr(items) = nodes.v else {
        errs.push(
            nodes.pos,
            format!("\"nodes\" must be an array, found {}", nodes.v.kind()),
        );
        return vec![];
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        if errs.is_full() {
            break;
        }
        if let Some(n) = raw_node(i, item, errs) {
            out.push(n);
        }
    }
    out
}

/// The optional `"train"` object (see [`crate::train::TrainSpec`]).
fn train_section(v: Spanned<'_>, errs: &mut Errors<'_>) -> Option<crate::train::TrainSpec> {
    let J::Obj(fields) = v.v else {
        errs.push(
            v.pos,
            format!("\"train\" must be an object, found {}", v.v.kind()),
        );
        return None;
    };
    let fields = fields
        .into_iter()
        .map(|(k, x)| (k.v.into_owned(), x.pos, x.into_value()))
        .collect();
    match crate::train::spec_from_fields(fields, v.pos) {
        Ok(spec) => Some(spec),
        Err(list) => {
            for (pos, m) in list {
                errs.push(pos, m);
            }
            None
        }
    }
}

/// `path` is only built when there is an error to report.
fn string_at(
    path: impl Fn() -> String,
    v: Spanned<'_>,
    errs: &mut Errors<'_>,
) -> Option<At<String>> {
    match v.v {
        J::Str(s) => Some(At {
            v: s.into_owned(),
            pos: v.pos,
        }),
        other => {
            errs.push(
                v.pos,
                format!("{} must be a string, found {}", path(), other.kind()),
            );
            None
        }
    }
}

fn strings_at(path: impl Fn() -> String, v: Spanned<'_>, errs: &mut Errors<'_>) -> Vec<At<String>> {
    match v.v {
        J::Arr(items) => items
            .into_iter()
            .enumerate()
            .filter_map(|(i, x)| string_at(|| format!("{}[{i}]", path()), x, errs))
            .collect(),
        other => {
            errs.push(
                v.pos,
                format!(
                    "{} must be an array of strings, found {}",
                    path(),
                    other.kind()
                ),
            );
            vec![]
        }
    }
}

fn raw_node(i: usize, item: Spanned<'_>, errs: &mut Errors<'_>) -> Option<RawNode> {
    let J::Obj(fields) = item.v else {
        errs.push(
            item.pos,
            format!("nodes[{i}] must be an object, found {}", item.v.kind()),
        );
        return None;
    };
    let mut n = RawNode {
        pos: item.pos,
        ..RawNode::default()
    };
    for (k, v) in fields {
        let path = || format!("nodes[{i}].{}", k.v);
        match k.v.as_ref() {
            "name" => n.name = string_at(path, v, errs),
            "op" => n.op = string_at(path, v, errs),
            "inputs" => n.inputs = strings_at(path, v, errs),
            "device" => n.device = string_at(path, v, errs).map(|d| d.v).unwrap_or_default(),
            "colocate_with" => n.colocate_with = strings_at(path, v, errs),
            "attrs" => match v.v {
                J::Obj(attrs) => {
                    n.attrs = attrs
                        .into_iter()
                        .map(|(k, v)| {
                            let pos = v.pos;
                            (
                                At {
                                    v: k.v.into_owned(),
                                    pos: k.pos,
                                },
                                At {
                                    v: v.into_value(),
                                    pos,
                                },
                            )
                        })
                        .collect();
                }
                other => errs.push(
                    v.pos,
                    format!("{} must be an object, found {}", path(), other.kind()),
                ),
            },
            _ => errs.push(
                k.pos,
                format!(
                    "unknown field {} (a node has name, op, inputs, device, \
                     colocate_with, attrs)",
                    path()
                ),
            ),
        }
    }
    for (missing, field) in [(n.name.is_none(), "name"), (n.op.is_none(), "op")] {
        if missing {
            errs.push(item.pos, format!("nodes[{i}] is missing {field:?}"));
        }
    }
    (n.name.is_some() && n.op.is_some()).then_some(n)
}

/// Writes a graph as pretty JSON (2-space indent, fields in a fixed order, attrs sorted by name,
/// empty fields left out, attr values on one line). Always writes the current format version.
pub fn to_json(def: &GraphDef) -> String {
    let mut out = String::with_capacity(64 + def.nodes.len() * 96);
    let _ = write!(
        out,
        "{{\n  \"format\": {},\n  \"version\": {FORMAT_VERSION},\n  \"nodes\": [",
        quote(FORMAT_TAG)
    );
    for (i, n) in def.nodes.iter().enumerate() {
        out.push_str(if i == 0 { "\n" } else { ",\n" });
        let _ = write!(
            out,
            "    {{\n      \"name\": {},\n      \"op\": {}",
            quote(&n.name),
            quote(&n.op)
        );
        if !n.inputs.is_empty() {
            out.push_str(",\n      \"inputs\": ");
            write_string_list(&mut out, &n.inputs);
        }
        if !n.device.is_empty() {
            let _ = write!(out, ",\n      \"device\": {}", quote(&n.device));
        }
        if !n.colocate_with.is_empty() {
            out.push_str(",\n      \"colocate_with\": ");
            write_string_list(&mut out, &n.colocate_with);
        }
        if !n.attrs.is_empty() {
            out.push_str(",\n      \"attrs\": {");
            for (j, (k, v)) in n.attrs.iter().enumerate() {
                out.push_str(if j == 0 { "\n" } else { ",\n" });
                let _ = write!(out, "        {}: ", quote(k));
                write_inline(&mut out, &attr_to_json(v));
            }
            out.push_str("\n      }");
        }
        out.push_str("\n    }");
    }
    if !def.nodes.is_empty() {
        out.push_str("\n  ");
    }
    out.push(']');
    if let Some(t) = &def.train {
        out.push_str(",\n  \"train\": {\n    \"loss\": ");
        out.push_str(&quote(&t.loss));
        out.push_str(",\n    \"optimizer\": ");
        write_inline(&mut out, &crate::train::optimizer_to_json(&t.optimizer));
        if let Some(c) = t.clip_global_norm {
            out.push_str(",\n    \"clip_global_norm\": ");
            write_inline(&mut out, &Value::from(c));
        }
        if !t.metrics.is_empty() {
            out.push_str(",\n    \"metrics\": ");
            write_string_list(&mut out, &t.metrics);
        }
        if let Some(schedule) = &t.lr_schedule {
            out.push_str(",\n    \"lr_schedule\": ");
            write_inline(&mut out, &crate::train::schedule_to_json(schedule));
        }
        if let Some(data) = &t.data {
            out.push_str(",\n    \"data\": ");
            write_inline(&mut out, &crate::train::data_to_json(data));
        }
        out.push_str("\n  }");
    }
    out.push_str("\n}\n");
    out
}

fn quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

fn write_string_list(out: &mut String, items: &[String]) {
    out.push('[');
    for (i, s) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&quote(s));
    }
    out.push(']');
}

/// One-line JSON with `", "` and `": "` separators.
fn write_inline(out: &mut String, v: &Value) {
    match v {
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_inline(out, x);
            }
            out.push(']');
        }
        Value::Object(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&quote(k));
                out.push_str(": ");
                write_inline(out, x);
            }
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}
