//! How a Machine's bootstrap data reaches the boot plane without the boot plane reading Secrets
//! in tenants' namespaces. The boot plane faces the untrusted segment; whoever takes over its
//! process must not gain the right to read any Secret of the cluster. So, while a host's
//! provisioning waits for its data, the SitebootMachine reconciler (the controller) copies the
//! Machine's bootstrap Secret into one Secret in the appliance's own namespace, named for the
//! SitebootMachine and annotated with the Host and operation it is for. The boot plane reads
//! only that Secret, and only for the operation it serves; the controller deletes it once the
//! data was delivered or the operation ended. Taking over the boot plane then yields what is
//! staged (the data of hosts being provisioned, which it serves anyway), not the cluster's
//! Secrets.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams};

/// The operation a staged Secret is for.
pub const OPERATION_ANNOTATION: &str = "siteboot.dev/operation";
/// The Host (`namespace/name`) a staged Secret is for.
pub const HOST_ANNOTATION: &str = "siteboot.dev/host";
/// The field manager of the staged Secrets.
const MANAGER: &str = "siteboot-handoff";

/// The staged Secret of the SitebootMachine with uid `machine_uid` (one host at a time).
pub fn secret_name(machine_uid: &str) -> String {
    format!("siteboot-bootstrap-{machine_uid}")
}

/// A Machine's bootstrap data, as its bootstrap Secret holds it (the contract's keys `value` and
/// `format`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapData {
    pub value: Vec<u8>,
    /// `cloud-config` (the contract's default) or `ignition`.
    pub format: String,
}

impl BootstrapData {
    /// The data of a bootstrap Secret; `None` without the key `value`.
    pub fn of(secret: &Secret) -> Option<Self> {
        let data = secret.data.as_ref()?;
        let value = data.get("value")?.0.clone();
        let format = data
            .get("format")
            .map(|f| String::from_utf8_lossy(&f.0).into_owned())
            .unwrap_or_else(|| "cloud-config".into());
        Some(Self { value, format })
    }
}

/// What the boot plane may read: which operation of which Host the data is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    pub host: String,
    pub operation: String,
}

impl Staged {
    pub fn of(meta: &ObjectMeta) -> Option<Self> {
        let annotations = meta.annotations.as_ref()?;
        Some(Self {
            host: annotations.get(HOST_ANNOTATION)?.clone(),
            operation: annotations.get(OPERATION_ANNOTATION)?.clone(),
        })
    }
}

/// The staged copy of `data` for `staged`, in `namespace`.
pub fn staged_secret(
    namespace: &str,
    machine_uid: &str,
    staged: &Staged,
    data: &BootstrapData,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(machine_uid)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                "siteboot".to_owned(),
            )])),
            annotations: Some(BTreeMap::from([
                (HOST_ANNOTATION.to_owned(), staged.host.clone()),
                (OPERATION_ANNOTATION.to_owned(), staged.operation.clone()),
            ])),
            ..Default::default()
        },
        type_: Some("siteboot.dev/bootstrap-data".to_owned()),
        data: Some(BTreeMap::from([
            ("value".to_owned(), ByteString(data.value.clone())),
            ("format".to_owned(), ByteString(data.format.clone().into_bytes())),
        ])),
        ..Default::default()
    }
}

/// Stages `data` for `staged` (the controller), replacing what was staged for the machine.
pub async fn stage(
    client: &kube::Client,
    namespace: &str,
    machine_uid: &str,
    staged: &Staged,
    data: &BootstrapData,
) -> Result<(), kube::Error> {
    let secret = staged_secret(namespace, machine_uid, staged, data);
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let params = PatchParams::apply(MANAGER).force();
    api.patch(&secret_name(machine_uid), &params, &Patch::Apply(&secret)).await?;
    Ok(())
}

/// What is staged for the machine, read from the metadata only (the controller).
pub async fn staged(
    client: &kube::Client,
    namespace: &str,
    machine_uid: &str,
) -> Result<Option<Staged>, kube::Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let meta = api.get_metadata_opt(&secret_name(machine_uid)).await?;
    Ok(meta.and_then(|m| Staged::of(&m.metadata)))
}

/// Deletes what is staged for the machine, if anything (the controller).
pub async fn unstage(
    client: &kube::Client,
    namespace: &str,
    machine_uid: &str,
) -> Result<(), kube::Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    match api.delete(&secret_name(machine_uid), &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// The data staged for the machine, if it is for `expected` (the boot plane); `None`: not
/// staged (yet), or staged for another Host or operation.
pub async fn read(
    client: &kube::Client,
    namespace: &str,
    machine_uid: &str,
    expected: &Staged,
) -> Result<Option<BootstrapData>, kube::Error> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let Some(secret) = api.get_opt(&secret_name(machine_uid)).await? else { return Ok(None) };
    if Staged::of(&secret.metadata).as_ref() != Some(expected) {
        return Ok(None);
    }
    Ok(BootstrapData::of(&secret))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staged_secret_names_its_host_and_operation_and_keeps_the_data_as_it_was() {
        let value = BTreeMap::from([("value".to_owned(), ByteString(b"#!/bin/sh".to_vec()))]);
        let source = Secret { data: Some(value), ..Default::default() };
        let data = BootstrapData::of(&source).unwrap();
        assert_eq!(data.format, "cloud-config", "the contract's default format");
        let staged = Staged { host: "metal/node-1".into(), operation: "op-1".into() };
        let secret = staged_secret("siteboot-system", "uid-1", &staged, &data);
        assert_eq!(secret.metadata.name.as_deref(), Some("siteboot-bootstrap-uid-1"));
        assert_eq!(Staged::of(&secret.metadata), Some(staged));
        assert_eq!(BootstrapData::of(&secret), Some(data));
        assert_eq!(BootstrapData::of(&Secret::default()), None, "no value: no data");
    }
}
