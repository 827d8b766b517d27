//! The type part of a device name (`CPU`, `GPU`, …): one value for the device names, the
//! kernel registry and the executor, so no crate compares device types as literal strings.

use std::borrow::Cow;
use std::fmt;

/// A device type: an identifier (`[A-Za-z][A-Za-z0-9_]*`) stored upper-case. The two dflow
/// knows are [`DeviceType::CPU`] and [`DeviceType::GPU`]; any other parses too (TensorFlow's
/// graphs name `TPU`, `XLA_CPU`, …), so a graph written for other hardware still loads and its
/// placement errors can name the type.
///
/// Ordered and compared by its text, so sorted device lists keep TensorFlow's order.
///
/// ```
/// use dflow_graph::DeviceType;
///
/// assert_eq!(DeviceType::parse("gpu"), Some(DeviceType::GPU));
/// assert_eq!(DeviceType::parse("xla_cpu").map(|t| t.to_string()).as_deref(), Some("XLA_CPU"));
/// assert_eq!(DeviceType::parse("2gpu"), None);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceType(Cow<'static, str>);

impl DeviceType {
    /// The host processor: every dflow task has `CPU:0`, and every op has a CPU kernel.
    pub const CPU: DeviceType = DeviceType(Cow::Borrowed("CPU"));
    /// A GPU (kernels for it come with the CUDA backend).
    pub const GPU: DeviceType = DeviceType(Cow::Borrowed("GPU"));

    /// The type named by `text` (any case), or `None` if `text` is not an identifier.
    pub fn parse(text: &str) -> Option<DeviceType> {
        if !is_identifier(text) {
            return None;
        }
        Some(
            [DeviceType::CPU, DeviceType::GPU]
                .into_iter()
                .find(|known| known.as_str().eq_ignore_ascii_case(text))
                .unwrap_or_else(|| DeviceType(Cow::Owned(text.to_ascii_uppercase()))),
        )
    }

    /// The upper-case name, as written in device names (`CPU`).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// True if `name` is `[A-Za-z][A-Za-z0-9_]*` (device types and job names).
pub(crate) fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_one_upper_case_value() {
        assert_eq!(DeviceType::parse("cpu"), Some(DeviceType::CPU));
        assert_eq!(DeviceType::parse("CPU"), Some(DeviceType::CPU));
        assert_eq!(DeviceType::parse("Gpu"), Some(DeviceType::GPU));
        let tpu = DeviceType::parse("tpu").map(|t| t.as_str().to_string());
        assert_eq!(tpu.as_deref(), Some("TPU"));
        for bad in ["", "1cpu", "c-pu", "*", "cpu:0"] {
            assert_eq!(DeviceType::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn types_order_by_their_names() {
        let mut types = [
            DeviceType::GPU,
            DeviceType::parse("XLA_CPU").unwrap(),
            DeviceType::CPU,
        ];
        types.sort();
        let names: Vec<_> = types.iter().map(DeviceType::as_str).collect();
        assert_eq!(names, ["CPU", "GPU", "XLA_CPU"]);
    }
}
