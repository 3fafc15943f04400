//! The SitebootMachine side: the Cluster API InfraMachine contract (v1beta2). [`plan`] decides
//! the one next step from what was read, [`write`](mod@write) what that step writes (object,
//! patch, guard); [`reconciler`] reads, performs it and reports.
//!
//! In order, a pass:
//! 1. honours pause (Cluster or annotation): reports Paused and changes nothing
//! 2. on delete: lets go of `Host.spec.provisioning` (the Host wipes itself), waits for the
//!    wipe, releases the Host, drops the finalizer
//! 3. adds the finalizer
//! 4. waits for the Machine, the Cluster and its infrastructure, and the bootstrap data Secret
//! 5. binds a Host: marks the machine with the host it will claim, claims the Host by
//!    compare-and-swap on its `spec.consumerRef`, records it in `spec.hostRef`
//! 6. asks the Host for the image (`Host.spec.provisioning`)
//! 7. once the Host is Provisioned: `spec.providerID`, `status.addresses`,
//!    `status.initialization.provisioned`, Ready
//!
//! Claims it did not make or no longer uses are given back on the way.

pub mod plan;
pub mod reconciler;
pub mod write;

pub use plan::{BINDER_ANNOTATION, FINALIZER};
pub use reconciler::run;
