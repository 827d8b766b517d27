//! dflow executor (filled by later issues).
