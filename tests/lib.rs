//! Shared helpers for integration tests.

pub mod digits_setup;
pub mod peak_alloc;
