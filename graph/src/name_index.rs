//! Name → node lookup for [`Graph`](crate::Graph) that stores node indices only.
//!
//! A `HashMap<String, NodeIndex>` keeps a second copy of every node name (one allocation and 32
//! bytes of entry per node). This table keeps only the 4-byte index and compares against the
//! name stored in the node itself, hashing with foldhash (randomly seeded per table, so a crafted
//! graph cannot predict collisions).

use hashbrown::{DefaultHashBuilder, HashTable};
use std::fmt;
use std::hash::BuildHasher;

/// Node indices keyed by the node's name; the names themselves live in the graph's nodes.
#[derive(Clone, Default)]
pub(crate) struct NameIndex {
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
}

impl fmt::Debug for NameIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NameIndex")
            .field("len", &self.table.len())
            .finish()
    }
}

impl NameIndex {
    /// An empty index with room for `n` names.
    pub(crate) fn with_capacity(n: usize) -> NameIndex {
        NameIndex {
            table: HashTable::with_capacity(n),
            hasher: DefaultHashBuilder::default(),
        }
    }

    fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    /// The index stored under `name`; `name_of` gives the name of a stored index.
    pub(crate) fn get<'a>(&self, name: &str, name_of: impl Fn(u32) -> &'a str) -> Option<u32> {
        self.table
            .find(self.hash(name), |&i| name_of(i) == name)
            .copied()
    }

    /// Stores `idx` under `name`, or returns the index already stored under it.
    pub(crate) fn insert<'a>(
        &mut self,
        name: &str,
        idx: u32,
        name_of: impl Fn(u32) -> &'a str,
    ) -> Result<(), u32> {
        let hash = self.hash(name);
        if let Some(&first) = self.table.find(hash, |&i| name_of(i) == name) {
            return Err(first);
        }
        let hasher = &self.hasher;
        self.table
            .insert_unique(hash, idx, |&i| hasher.hash_one(name_of(i)));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_what_was_inserted_and_rejects_duplicates() {
        let names: Vec<String> = (0..1000).map(|i| format!("n{i}")).collect();
        let name_of = |i: u32| names[i as usize].as_str();
        let mut ix = NameIndex::with_capacity(4); // forces rehashing
        for i in 0..names.len() as u32 {
            assert_eq!(ix.insert(&names[i as usize], i, name_of), Ok(()));
        }
        assert_eq!(ix.table.len(), 1000);
        assert_eq!(ix.insert("n7", 5, name_of), Err(7));
        for (i, n) in names.iter().enumerate() {
            assert_eq!(ix.get(n, name_of), Some(i as u32));
        }
        assert_eq!(ix.get("n1000", name_of), None);
        let mut all: Vec<u32> = ix.table.iter().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<u32>>());
    }
}
