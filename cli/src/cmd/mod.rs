//! One module per subcommand.
pub mod check;
pub mod common;
pub mod convert;
pub mod partition;
pub mod run;
pub mod train;
