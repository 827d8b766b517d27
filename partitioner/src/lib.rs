//! dflow partitioner (filled by later issues).
