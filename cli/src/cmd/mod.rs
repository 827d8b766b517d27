//! One module per subcommand.
pub mod check;
pub mod convert;
pub mod partition;
pub mod run;
