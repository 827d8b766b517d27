//! Example helpers.
