//! The Host side: the lifecycle rules and the reconciler that applies them.

pub mod lifecycle;
pub mod reconciler;
