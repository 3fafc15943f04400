//! The Host side: the lifecycle rules, the record that carries them through `clusterctl move`
//! and restores, the plan that picks a pass's one step from them, and the reconciler that
//! performs it.

pub mod lifecycle;
pub mod plan;
pub mod reconciler;
pub mod record;
pub mod write;
