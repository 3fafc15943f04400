//! The site's DHCP lease checkpoint (see `siteboot_boot::dhcp::checkpoint` for the protocol):
//! a ConfigMap `siteboot-<site>-dhcp-leases` in the appliance's namespace with one entry per
//! address (`10.99.0.100: {"addr":…,"mac":…,"expires":…}`), so a save patches only the addresses
//! whose lease changed. Every save is a merge patch carrying the resourceVersion this replica
//! last read or wrote: if anyone else wrote since, it is refused.

use std::sync::Mutex;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use siteboot_boot::dhcp::checkpoint::{self, LeaseCheckpoint};
use siteboot_boot::dhcp::leases::Lease;
use siteboot_boot::inventory::BoxFuture;

use crate::context::patch_unchanged;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(
        "the lease checkpoint {0} changed since this replica last read it (another replica leads, or led meanwhile)"
    )]
    Changed(String),
    #[error("lease checkpoint {name}: {source}")]
    Api { name: String, source: kube::Error },
    #[error("lease checkpoint {name}: {source}")]
    Encode { name: String, source: serde_json::Error },
}

pub struct ConfigMapCheckpoint {
    api: Api<ConfigMap>,
    name: String,
    /// The ConfigMap's metadata as this replica last read or wrote it (`None`: it did not
    /// exist): its resourceVersion fences the next save.
    last: Mutex<Option<ObjectMeta>>,
}

impl ConfigMapCheckpoint {
    pub fn new(client: Client, namespace: &str, site: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: format!("siteboot-{site}-dhcp-leases"),
            last: Mutex::new(None),
        }
    }

    fn api_error(&self, source: kube::Error) -> CheckpointError {
        match source {
            kube::Error::Api(e) if e.code == 409 => CheckpointError::Changed(self.name.clone()),
            source => CheckpointError::Api { name: self.name.clone(), source },
        }
    }

    fn remember(&self, written: &ConfigMap) {
        *self.last.lock().expect("checkpoint lock") = Some(written.metadata.clone());
    }

    async fn read(&self) -> Result<Vec<Lease>, CheckpointError> {
        let found = self.api.get_opt(&self.name).await.map_err(|e| self.api_error(e))?;
        let Some(config_map) = found else {
            *self.last.lock().expect("checkpoint lock") = None;
            return Ok(Vec::new());
        };
        self.remember(&config_map);
        let entries = config_map.data.unwrap_or_default();
        let mut leases = Vec::with_capacity(entries.len());
        for (address, value) in entries {
            match serde_json::from_str::<Lease>(&value) {
                Ok(lease) if lease.addr.to_string() == address => leases.push(lease),
                // Someone edited it by hand: skip the entry rather than lose the others.
                _ => {
                    tracing::warn!(checkpoint = %self.name, %address, "skipping an unreadable lease checkpoint entry")
                }
            }
        }
        Ok(leases)
    }

    async fn write(&self, leases: Vec<Lease>) -> Result<(), CheckpointError> {
        let encode = |source| CheckpointError::Encode { name: self.name.clone(), source };
        let mut data = serde_json::Map::new();
        for lease in &leases {
            data.insert(
                lease.addr.to_string(),
                serde_json::to_string(lease).map_err(encode)?.into(),
            );
        }
        let last = self.last.lock().expect("checkpoint lock").clone();
        let written = match last {
            // The first leader of the site: the create fails if another replica made it first.
            None => {
                let config_map = ConfigMap {
                    metadata: ObjectMeta { name: Some(self.name.clone()), ..ObjectMeta::default() },
                    data: Some(
                        data.into_iter()
                            .map(|(k, v)| (k, v.as_str().unwrap_or_default().to_owned()))
                            .collect(),
                    ),
                    ..ConfigMap::default()
                };
                self.api
                    .create(&PostParams::default(), &config_map)
                    .await
                    .map_err(|e| self.api_error(e))?
            }
            Some(metadata) => {
                let read = ConfigMap { metadata, ..ConfigMap::default() };
                patch_unchanged(&self.api, &read, serde_json::json!({ "data": data }))
                    .await
                    .map_err(|e| self.api_error(e))?
                    .ok_or_else(|| CheckpointError::Changed(self.name.clone()))?
            }
        };
        self.remember(&written);
        Ok(())
    }
}

impl LeaseCheckpoint for ConfigMapCheckpoint {
    fn load(&self) -> BoxFuture<'_, Result<Vec<Lease>, checkpoint::CheckpointError>> {
        Box::pin(async { self.read().await.map_err(Into::into) })
    }

    fn save(&self, leases: Vec<Lease>) -> BoxFuture<'_, Result<(), checkpoint::CheckpointError>> {
        Box::pin(async { self.write(leases).await.map_err(Into::into) })
    }
}
