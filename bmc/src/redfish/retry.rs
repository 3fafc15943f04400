//! When a failed Redfish request is tried again, as a pure decision: a bounded number of
//! attempts with exponential backoff, and only for failures another attempt can fix. An
//! action that may have reached the BMC (a reset whose answer timed out) is not repeated: the
//! host would be reset twice.

use std::time::Duration;

use crate::BmcError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (at least 1).
    pub attempts: u32,
    /// The wait after the first failure; doubled after each further one.
    pub first_delay: Duration,
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 4,
            first_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(8),
        }
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    RetryAfter(Duration),
    GiveUp,
}

/// After attempt number `attempt` (1 for the first) failed with `error`. `idempotent`: the
/// request can be repeated harmlessly (GET, PATCH of the boot override, DELETE).
pub fn after_failure(
    policy: &RetryPolicy,
    attempt: u32,
    idempotent: bool,
    error: &BmcError,
) -> Next {
    let transient = match error {
        // Nothing was sent: safe to repeat anything.
        BmcError::Unreachable { .. } => true,
        // The request may have been carried out.
        BmcError::Timeout { .. } | BmcError::ServerError { .. } => idempotent,
        _ => false,
    };
    if !transient || attempt >= policy.attempts {
        return Next::GiveUp;
    }
    let doubled = policy.first_delay.saturating_mul(1 << (attempt - 1).min(16));
    Next::RetryAfter(doubled.min(policy.max_delay))
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: RetryPolicy = RetryPolicy {
        attempts: 4,
        first_delay: Duration::from_millis(500),
        max_delay: Duration::from_secs(1),
    };

    fn unreachable() -> BmcError {
        BmcError::Unreachable { address: "h:1".into(), attempts: 1, reason: "refused".into() }
    }

    #[test]
    fn unreachable_is_retried_with_growing_delays_up_to_the_bound() {
        let e = unreachable();
        assert_eq!(
            after_failure(&POLICY, 1, false, &e),
            Next::RetryAfter(Duration::from_millis(500))
        );
        assert_eq!(after_failure(&POLICY, 2, false, &e), Next::RetryAfter(Duration::from_secs(1)));
        // Capped at max_delay.
        assert_eq!(after_failure(&POLICY, 3, false, &e), Next::RetryAfter(Duration::from_secs(1)));
        assert_eq!(after_failure(&POLICY, 4, false, &e), Next::GiveUp);
    }

    #[test]
    fn a_request_that_may_have_been_carried_out_is_repeated_only_if_idempotent() {
        let timeout =
            BmcError::Timeout { address: "h:1".into(), after: Duration::from_secs(1), attempts: 1 };
        let server =
            BmcError::ServerError { path: "/x".into(), attempts: 1, message: "500".into() };
        for e in [timeout, server] {
            assert!(matches!(after_failure(&POLICY, 1, true, &e), Next::RetryAfter(_)), "{e}");
            assert_eq!(after_failure(&POLICY, 1, false, &e), Next::GiveUp, "{e}");
        }
    }

    #[test]
    fn answers_another_attempt_cannot_change_are_final() {
        let final_errors = [
            BmcError::Unauthorized { address: "h:1".into() },
            BmcError::NotFound { path: "/x".into() },
            BmcError::Untrusted { address: "h:1".into(), reason: "pin".into() },
            BmcError::Rejected { path: "/x".into(), message: "400".into() },
            BmcError::Protocol("garbage".into()),
        ];
        for e in final_errors {
            assert_eq!(after_failure(&POLICY, 1, true, &e), Next::GiveUp, "{e}");
        }
    }
}
