//! Leases shared by the replicas of a site.
//!
//! Several appliances may serve one site; the leader alone answers full-mode DHCP. When
//! leadership moves, the new leader must not hand out an address that a lease of the old one
//! still holds. Each replica's own [journal](super::journal) cannot tell it that, so the leases
//! also go to a checkpoint every replica can read (in Kubernetes mode, a ConfigMap per site):
//!
//! - **Written before the client is told.** A batch's leases are saved to the checkpoint, like
//!   the journal, before any reply of the batch is sent (one write per batch: the socket loop's
//!   group commit). Every lease a client has heard of is therefore in the checkpoint, renewals
//!   included. If the write fails, the replies that depend on it are withheld; clients retry.
//! - **Read before answering.** A replica that becomes leader loads the checkpoint and
//!   [merges](super::leases::LeaseTable::merge) it into its table before it answers anything
//!   (at once, without waiting for a client), keeping the longer lease where the two disagree.
//! - **Read by standbys.** A standby reads and merges it the same way every few seconds: its
//!   boot plane, which serves HTTP and TFTP too, knows the leader's clients by their addresses
//!   (identity, see [`neighbors`](crate::neighbors)), and a takeover starts from a recent view.
//! - **Fenced.** A save is a compare-and-swap on what this replica last read or wrote, so a
//!   deposed leader whose write arrives late (a hung call, a frozen process) is refused and
//!   withholds its replies; after any refused or failed save the leader reloads first.
//!   Leadership itself is a [term with a deadline](crate::leadership): the old leader stops
//!   answering before the Lease can expire and another replica take it.
//!
//! What is lost in the worst case: offers (never promised to anyone), declined addresses (kept
//! per replica: a new leader may offer such an address again, the client declines it again and
//! it is quarantined again), and releases a replica missed (it keeps the longer lease, so the
//! address stays taken until that lease would have ended). Each loss leaves an address unused
//! for a while; none gives one address to two MACs. The checkpoint holds one entry per address
//! ever leased in the pools, so it stays within a ConfigMap's 1 MiB up to about ten thousand
//! addresses per site. Expiry times are wall-clock seconds: replicas need synchronised clocks
//! (NTP), as any DHCP failover does.

use super::leases::Lease;
use crate::inventory::BoxFuture;

pub type CheckpointError = Box<dyn std::error::Error + Send + Sync>;

/// Where the leases of a site's replicas meet.
pub trait LeaseCheckpoint: Send + Sync + 'static {
    /// Every lease the checkpoint holds. Saves after this succeed only while nobody else
    /// writes the checkpoint.
    fn load(&self) -> BoxFuture<'_, Result<Vec<Lease>, CheckpointError>>;

    /// Records `leases` (new, renewed or released) in the checkpoint. Fails if the checkpoint
    /// changed since this replica's last load or save.
    fn save(&self, leases: Vec<Lease>) -> BoxFuture<'_, Result<(), CheckpointError>>;
}
