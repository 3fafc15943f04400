//! When a ramdisk counts as gone: the rule both modes apply to an operation under way, each to
//! its own record, and the lifetimes it is measured against.

use std::time::Duration;

use crate::OperationKind;

/// How long a ramdisk token stays valid after it is issued: in standalone mode, and in
/// Kubernetes mode unless configured (`kubernetes.token_max_age`).
pub const TOKEN_MAX_AGE: Duration = Duration::from_secs(2 * 3600);

/// How long a ramdisk that booted for an operation may go without a word before its host is
/// quarantined (standalone: its operation fails), unless configured
/// (`kubernetes.ramdisk_silence_timeout`; standalone, `ramdisk_silence_timeout`). The agent
/// reports progress every few seconds while it works.
pub const RAMDISK_SILENCE_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// What the silence rule reads of an operation. Both modes keep these, each in its own record
/// (a Host's status, a standalone host's file); times in seconds since the Unix epoch.
#[derive(Debug, Clone, Copy)]
pub struct RamdiskContact<'a> {
    pub kind: OperationKind,
    pub id: &'a str,
    /// When the ramdisk last took a token: it booted for the operation.
    pub token_issued: Option<i64>,
    /// When it last reported.
    pub last_heard: Option<i64>,
    /// What it last said it was doing.
    pub step: Option<&'a str>,
}

/// Why an operation's ramdisk counts as gone, if it does: it booted for the operation (took a
/// token) and has then said nothing for more than `max_silence`: it hung, lost its network or
/// crashed. A host that never booted the ramdisk is not timed out: without a BMC, siteboot
/// waits for it to network-boot. The message depends on the record and the limit, not on
/// `now`, so checking again a moment later gives the same one.
pub fn ramdisk_silence(op: &RamdiskContact<'_>, now: i64, max_silence: Duration) -> Option<String> {
    let last = op.token_issued.into_iter().chain(op.last_heard).max()?;
    let silent_for = u64::try_from(now.saturating_sub(last)).unwrap_or(0);
    if silent_for <= max_silence.as_secs() {
        return None;
    }
    let step = op.step.map(|s| format!(" (its last step: {s})")).unwrap_or_default();
    Some(format!(
        "ramdisk silent for more than {} during {:?} operation {}{step}",
        humantime::format_duration(max_silence),
        op.kind,
        op.id
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_silence_rule_counts_from_the_last_sign_of_life() {
        let limit = Duration::from_secs(15 * 60);
        let op = |token_issued, last_heard| RamdiskContact {
            kind: OperationKind::Deprovision,
            id: "0123abcd",
            token_issued,
            last_heard,
            step: None,
        };
        assert_eq!(ramdisk_silence(&op(None, None), 1_000_000, limit), None, "never booted");
        assert_eq!(ramdisk_silence(&op(Some(100), None), 100 + 900, limit), None, "at the limit");
        let message = ramdisk_silence(&op(Some(100), None), 100 + 901, limit).unwrap();
        assert_eq!(
            message,
            "ramdisk silent for more than 15m during Deprovision operation 0123abcd"
        );
        assert_eq!(
            ramdisk_silence(&op(Some(100), Some(500)), 1001, limit),
            None,
            "a report restarts the count"
        );
        let later = ramdisk_silence(&op(Some(100), Some(500)), 5000, limit);
        assert_eq!(later.as_deref(), Some(message.as_str()), "the same message whenever checked");
        assert_eq!(
            ramdisk_silence(&op(Some(100), None), 50, limit),
            None,
            "a clock that went back"
        );
    }
}
