//! dflow transport (filled by later issues).
