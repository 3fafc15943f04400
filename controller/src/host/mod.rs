//! The Host side: the lifecycle rules, the record that carries them through `clusterctl move`
//! and restores, and the reconciler that applies them.

pub mod lifecycle;
pub mod reconciler;
pub mod record;
