//! Types shared by several kinds.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A machine address, as Cluster API's `MachineAddress`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineAddress {
    /// Hostname, ExternalIP, InternalIP, ExternalDNS or InternalDNS.
    #[serde(rename = "type")]
    pub kind: String,
    pub address: String,
}

/// Conditions are `metav1.Condition`s, keyed by `type` for server-side apply.
pub type Conditions = Vec<Condition>;

/// Sets the condition of `type_` (adding it if missing), keeping `lastTransitionTime` unless the
/// status changes. Returns whether anything changed.
pub fn set_condition(
    conditions: &mut Conditions,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
) -> bool {
    let status = if status { "True" } else { "False" };
    if let Some(c) = conditions.iter_mut().find(|c| c.type_ == type_) {
        if c.status == status && c.reason == reason && c.message == message {
            return false;
        }
        if c.status != status {
            c.last_transition_time = now();
        }
        c.status = status.to_owned();
        c.reason = reason.to_owned();
        c.message = message.to_owned();
        c.observed_generation = observed_generation;
        return true;
    }
    conditions.push(Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation,
        last_transition_time: now(),
    });
    true
}

pub fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

pub fn now() -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now())
}
