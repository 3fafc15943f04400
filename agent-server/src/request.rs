//! What every agent request is checked for, in both modes: which endpoint it asks for, whether
//! its token opens the host's operation ([`check_token`]), and why it is refused ([`Refusal`]).
//! A refusal says no more than the ramdisk needs, and is logged with who asked.

use std::fmt;

use http::{Method, StatusCode};
use siteboot_boot::arp_probe::Unconfirmed;
use siteboot_boot::inventory::{AgentRequest, AgentResponse};

use crate::{OperationKind, token};

/// The endpoints of the agent API; both modes serve the same ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Task,
    Inspection,
    Bootstrap,
    Progress,
    Complete,
}

impl Endpoint {
    /// The endpoint `req` asks for; `None`: no such endpoint (404).
    pub fn of(req: &AgentRequest) -> Option<Self> {
        Some(match (&req.method, req.path.as_str()) {
            (&Method::GET, "v1/task") => Endpoint::Task,
            (&Method::POST, "v1/inspection") => Endpoint::Inspection,
            (&Method::GET, "v1/bootstrap") => Endpoint::Bootstrap,
            (&Method::POST, "v1/progress") => Endpoint::Progress,
            (&Method::POST, "v1/complete") => Endpoint::Complete,
            _ => return None,
        })
    }
}

/// Logs a refused request and answers it, saying no more than the reason.
pub fn refused(req: &AgentRequest, refusal: &Refusal) -> AgentResponse {
    tracing::warn!(remote = %req.remote, mac = ?req.remote_mac, path = %req.path, reason = %refusal, "agent request refused");
    AgentResponse::text(refusal.status(), format!("refused: {refusal}\n"))
}

/// The refusals after which `GET task` answers [`Task::without_token`] rather than refuse.
pub fn needs_new_token(refusal: &Refusal) -> bool {
    matches!(
        refusal,
        Refusal::NoToken | Refusal::WrongToken | Refusal::Expired | Refusal::NoOperation
    )
}

/// What an operation's token was issued as.
#[derive(Debug, Clone, Copy)]
pub struct Grant<'a> {
    /// The SHA-256 of the token (none issued yet: every token is wrong).
    pub token_hash: Option<&'a str>,
    /// The address it was issued to.
    pub address: Option<&'a str>,
    /// It never crossed the segment: it came in virtual media through the host's BMC, or in the
    /// initrd of a kexec over SSH to the host's pinned host key. Holding it is the evidence,
    /// whatever address the request comes from.
    pub out_of_band: bool,
    /// Whether it was issued less than the token lifetime ago.
    pub fresh: bool,
}

/// Checks a request's token against its host's operation (`None`: no operation).
pub fn check_token(
    token: Option<&str>,
    grant: Option<Grant<'_>>,
    remote: std::net::Ipv4Addr,
) -> Result<(), Refusal> {
    let token = token.ok_or(Refusal::NoToken)?;
    let grant = grant.ok_or(Refusal::NoOperation)?;
    let hash = grant.token_hash.ok_or(Refusal::WrongToken)?;
    if !token::matches(token, hash) {
        return Err(Refusal::WrongToken);
    }
    if !grant.out_of_band && grant.address != Some(remote.to_string().as_str()) {
        return Err(Refusal::WrongAddress);
    }
    if !grant.fresh {
        return Err(Refusal::Expired);
    }
    Ok(())
}

/// Why an agent request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The request comes from an address with no known MAC.
    UnknownAddress,
    /// No Host has the MAC behind the address.
    UnknownHost,
    NoToken,
    /// The token is not the current one of the Host's operation (wrong, or from an earlier boot
    /// or operation).
    WrongToken,
    /// The token was issued to another address.
    WrongAddress,
    Expired,
    NoOperation,
    /// The request does not fit the operation (bootstrap data during a wipe, say).
    WrongOperation(OperationKind),
    /// Bootstrap data was already handed out for this operation.
    Replayed,
    /// The Host is not bound to a machine whose bootstrap data it may have (why, in words).
    NotBound(String),
    /// The Host is paused: nothing about it changes until the annotation goes (the ramdisk
    /// retries).
    Paused,
    /// The segment does not confirm, as secrets would leave, that the address is the MAC's.
    Unconfirmed(Unconfirmed),
    BadRequest(String),
}

impl Refusal {
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::NoToken => StatusCode::UNAUTHORIZED,
            Refusal::Replayed => StatusCode::CONFLICT,
            Refusal::Paused => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::BadRequest(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::FORBIDDEN,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::UnknownAddress => f.write_str("no MAC is known for this address"),
            Refusal::UnknownHost => f.write_str("no Host has this MAC"),
            Refusal::NoToken => f.write_str("no token"),
            Refusal::WrongToken => f.write_str("wrong token"),
            Refusal::WrongAddress => f.write_str("token issued to another address"),
            Refusal::Expired => f.write_str("token expired"),
            Refusal::NoOperation => f.write_str("no operation in progress"),
            Refusal::WrongOperation(k) => write!(f, "not allowed during {k:?}"),
            Refusal::Replayed => f.write_str("bootstrap data already delivered for this operation"),
            Refusal::NotBound(why) => write!(f, "not bound to a machine: {why}"),
            Refusal::BadRequest(m) => write!(f, "bad request: {m}"),
            Refusal::Paused => f.write_str("the Host is paused; try again later"),
            Refusal::Unconfirmed(why) => {
                write!(f, "the address is not confirmed as this host's: {why}")
            }
        }
    }
}

/// Reads a request body as `T`, or refuses it.
pub fn body<T: serde::de::DeserializeOwned>(req: &AgentRequest) -> Result<T, Refusal> {
    serde_json::from_slice(&req.body).map_err(|e| Refusal::BadRequest(e.to_string()))
}

/// Whether the segment confirms, now, that the request's address is its MAC's: asked as secrets
/// are about to leave, since a table entry naming the MAC can be planted or stale.
pub async fn confirm_holder(req: &AgentRequest) -> Result<(), Refusal> {
    let mac = req.remote_mac.ok_or(Refusal::UnknownAddress)?;
    req.segment.confirm(req.remote, mac).await.map_err(Refusal::Unconfirmed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_good_only_as_issued_to_its_address_and_in_time() {
        let (token, hash) = token::mint();
        let remote: std::net::Ipv4Addr = "10.0.0.5".parse().unwrap();
        let grant = Grant {
            token_hash: Some(&hash),
            address: Some("10.0.0.5"),
            out_of_band: false,
            fresh: true,
        };
        assert_eq!(check_token(Some(&token), Some(grant), remote), Ok(()));
        let refusal = |token: Option<&str>, grant: Option<Grant<'_>>, remote| {
            check_token(token, grant, remote).unwrap_err()
        };
        assert_eq!(refusal(None, Some(grant), remote), Refusal::NoToken);
        assert_eq!(refusal(Some(&token), None, remote), Refusal::NoOperation);
        assert_eq!(refusal(Some(&hash), Some(grant), remote), Refusal::WrongToken);
        let unissued = Grant { token_hash: None, ..grant };
        assert_eq!(refusal(Some(&token), Some(unissued), remote), Refusal::WrongToken);
        let elsewhere = "10.0.0.6".parse().unwrap();
        assert_eq!(refusal(Some(&token), Some(grant), elsewhere), Refusal::WrongAddress);
        let stale = Grant { fresh: false, ..grant };
        assert_eq!(refusal(Some(&token), Some(stale), remote), Refusal::Expired);
        assert!(needs_new_token(&Refusal::Expired) && !needs_new_token(&Refusal::WrongAddress));
        let from_media = Grant { address: None, out_of_band: true, ..grant };
        assert_eq!(check_token(Some(&token), Some(from_media), elsewhere), Ok(()));
        assert_eq!(refusal(Some(&hash), Some(from_media), elsewhere), Refusal::WrongToken);
        assert_eq!(
            refusal(Some(&token), Some(Grant { fresh: false, ..from_media }), elsewhere),
            Refusal::Expired
        );
    }
}
