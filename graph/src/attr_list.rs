//! [`Attrs`]: the attributes of one [`Node`](crate::Node), as a sorted list.
//!
//! A `BTreeMap<String, AttrValue>` allocates a leaf with room for eleven entries (about 900
//! bytes) as soon as it holds one, and a `String` per key. Nodes hold a handful of attributes at
//! most, and the partitioner makes hundreds of thousands of Send/Recv nodes with three to six
//! each, so `Attrs` keeps them in one vector sorted by name, with names that the op registry or
//! the caller knows statically borrowed rather than copied. Lookups are binary searches;
//! iteration is in name order, as a `BTreeMap`'s.

use crate::AttrValue;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

/// Attributes by name, sorted by name (what a `BTreeMap<String, AttrValue>` would hold).
#[derive(Clone, Default, PartialEq)]
pub struct Attrs {
    entries: Vec<(Cow<'static, str>, AttrValue)>,
}

impl Attrs {
    /// No attributes.
    pub fn new() -> Attrs {
        Attrs::default()
    }

    /// No attributes, with room for `n`.
    pub fn with_capacity(n: usize) -> Attrs {
        Attrs {
            entries: Vec::with_capacity(n),
        }
    }

    fn position(&self, name: &str) -> Result<usize, usize> {
        self.entries.binary_search_by(|(k, _)| (**k).cmp(name))
    }

    /// The value of attribute `name`.
    pub fn get(&self, name: &str) -> Option<&AttrValue> {
        self.position(name).ok().map(|i| &self.entries[i].1)
    }

    /// Whether attribute `name` is set.
    pub fn contains_key(&self, name: &str) -> bool {
        self.position(name).is_ok()
    }

    /// Sets attribute `name` (a `&'static str` is kept without copying), returning the value it
    /// replaces.
    pub fn insert(
        &mut self,
        name: impl Into<Cow<'static, str>>,
        value: AttrValue,
    ) -> Option<AttrValue> {
        let name = name.into();
        // Attributes are usually set in name order: then the new one goes last.
        if self.entries.last().map_or(true, |(last, _)| **last < *name) {
            self.entries.push((name, value));
            return None;
        }
        match self.position(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.entries[i].1, value)),
            Err(i) => {
                self.entries.insert(i, (name, value));
                None
            }
        }
    }

    /// Removes attribute `name`, returning its value.
    pub fn remove(&mut self, name: &str) -> Option<AttrValue> {
        self.position(name).ok().map(|i| self.entries.remove(i).1)
    }

    /// Number of attributes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no attribute is set.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// (name, value) in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &AttrValue)> + '_ {
        self.entries.iter().map(|(k, v)| (&**k, v))
    }

    /// Names, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> + '_ {
        self.entries.iter().map(|(k, _)| &**k)
    }

    /// The attributes as a map (the form [`NodeDef`](crate::NodeDef) and kernels use).
    pub fn to_map(&self) -> BTreeMap<String, AttrValue> {
        self.iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    /// Copies `map`, borrowing each name that `static_name` maps to a `&'static str`.
    pub fn from_map_with(
        map: &BTreeMap<String, AttrValue>,
        static_name: impl Fn(&str) -> Option<&'static str>,
    ) -> Attrs {
        // A map iterates in name order: the entries are sorted already.
        Attrs {
            entries: map
                .iter()
                .map(|(k, v)| {
                    let name = static_name(k).map_or_else(|| Cow::Owned(k.clone()), Cow::Borrowed);
                    (name, v.clone())
                })
                .collect(),
        }
    }
}

impl fmt::Debug for Attrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl From<&BTreeMap<String, AttrValue>> for Attrs {
    fn from(map: &BTreeMap<String, AttrValue>) -> Attrs {
        Attrs::from_map_with(map, |_| None)
    }
}

impl From<BTreeMap<String, AttrValue>> for Attrs {
    fn from(map: BTreeMap<String, AttrValue>) -> Attrs {
        Attrs {
            entries: map.into_iter().map(|(k, v)| (Cow::Owned(k), v)).collect(),
        }
    }
}

impl<K: Into<Cow<'static, str>>> FromIterator<(K, AttrValue)> for Attrs {
    /// Later values win over earlier ones of the same name, as in a map.
    fn from_iter<I: IntoIterator<Item = (K, AttrValue)>>(iter: I) -> Attrs {
        let mut attrs = Attrs::new();
        for (k, v) in iter {
            attrs.insert(k, v);
        }
        attrs
    }
}

impl<K: Into<Cow<'static, str>>, const N: usize> From<[(K, AttrValue); N]> for Attrs {
    fn from(entries: [(K, AttrValue); N]) -> Attrs {
        entries.into_iter().collect()
    }
}

impl std::ops::Index<&str> for Attrs {
    type Output = AttrValue;

    /// The value of an attribute that must be set.
    ///
    /// # Panics
    /// When the attribute is not set (as indexing a map does).
    fn index(&self, name: &str) -> &AttrValue {
        match self.get(name) {
            Some(v) => v,
            None => panic!("no attribute `{name}`"),
        }
    }
}

impl<'a> IntoIterator for &'a Attrs {
    type Item = (&'a str, &'a AttrValue);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Cow<'static, str>, AttrValue)>,
        fn(&'a (Cow<'static, str>, AttrValue)) -> (&'a str, &'a AttrValue),
    >;

    fn into_iter(self) -> Self::IntoIter {
        fn pair<'e>(e: &'e (Cow<'static, str>, AttrValue)) -> (&'e str, &'e AttrValue) {
            (&e.0, &e.1)
        }
        self.entries.iter().map(pair)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn behaves_like_a_sorted_map() {
        let mut a = Attrs::new();
        assert!(a.is_empty());
        assert_eq!(a.insert("shape", AttrValue::Int(1)), None);
        assert_eq!(
            a.insert(String::from("dtype"), AttrValue::DType(DType::F32)),
            None
        );
        assert_eq!(a.insert("axis", AttrValue::Int(0)), None);
        assert_eq!(
            a.insert("shape", AttrValue::Int(2)),
            Some(AttrValue::Int(1))
        );
        assert_eq!(a.keys().collect::<Vec<_>>(), ["axis", "dtype", "shape"]);
        assert_eq!(a["shape"], AttrValue::Int(2));
        assert!(a.contains_key("dtype") && !a.contains_key("dtyp"));
        assert_eq!(a.get("nope"), None);
        let map = a.to_map();
        assert_eq!(format!("{a:?}"), format!("{map:?}"));
        assert_eq!(Attrs::from(&map), a);
        assert_eq!(Attrs::from(map.clone()), a);
        let statics = Attrs::from_map_with(&map, |k| (k == "axis").then_some("axis"));
        assert_eq!(statics, a);
        assert_eq!(a.remove("axis"), Some(AttrValue::Int(0)));
        assert_eq!(a.len(), 2);
        let b: Attrs = [
            ("b", AttrValue::Int(1)),
            ("a", AttrValue::Int(2)),
            ("b", AttrValue::Int(3)),
        ]
        .into();
        assert_eq!(
            b.iter().collect::<Vec<_>>(),
            [("a", &AttrValue::Int(2)), ("b", &AttrValue::Int(3))]
        );
    }
}
