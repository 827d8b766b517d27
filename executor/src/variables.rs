//! Variables of one device: they live across steps and across compiled plans.

use dflow_graph::kernel::VariableCell;
use dflow_graph::Tensor;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The variables stored on one device, by variable node name.
#[derive(Debug, Default)]
pub struct VariableStore {
    cells: Mutex<BTreeMap<String, Arc<VariableCell>>>,
}

impl VariableStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The cell for variable `name`, created empty on first use.
    pub fn cell(&self, name: &str) -> Arc<VariableCell> {
        self.cells
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// Current values of every initialized variable, sorted by name.
    pub fn snapshot(&self) -> Vec<(String, Tensor)> {
        self.cells
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(k, c)| c.read().map(|t| (k.clone(), t)))
            .collect()
    }
}
