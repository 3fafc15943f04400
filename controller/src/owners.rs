//! The Cluster API Machines and Clusters that the provider's objects belong to, kept by the
//! watches that also wake those objects. A pass reads its Machine and Cluster here instead of
//! asking the API server: the store is written before the watch wakes anyone, so a pass woken by
//! a change sees that change. Only changes to what the provider reads wake anyone: CAPI writes
//! a Cluster's status with every Machine's progress, and each such write would otherwise wake
//! every machine of the cluster.

use std::collections::hash_map::DefaultHasher;
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, Stream, StreamExt};
use kube::api::Api;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::context::{Reconciled, owner_machine_ref};
use crate::crd::capi::{CLUSTER_NAME_LABEL, Cluster, Machine};

/// What an object belongs to, as last watched.
pub struct OwnedBy {
    pub machine: Option<Arc<Machine>>,
    pub cluster: Option<Arc<Cluster>>,
}

/// How soon a pass that found the owners not yet listed looks again.
pub const NOT_LISTED_RETRY: Duration = Duration::from_secs(1);

/// The Machines and Clusters of the management cluster, as last watched.
pub struct Owners {
    machines: Store<Machine>,
    clusters: Store<Cluster>,
}

impl Owners {
    /// Adds to `controller` a watch of Machines, waking the object `of_machine` names, and one
    /// of Clusters, waking every object labelled with the Cluster's name; both keep the stores
    /// returned.
    pub fn watch<K>(
        client: &kube::Client,
        controller: Controller<K>,
        of_machine: impl Fn(&Machine) -> Option<ObjectRef<K>> + Send + Sync + 'static,
    ) -> (Controller<K>, Owners)
    where
        K: Reconciled,
    {
        let objects = controller.store();
        let (machines, machine_changes) = reflected(Api::<Machine>::all(client.clone()));
        let machine_changes = machine_changes.predicate_filter(read_fields, Default::default());
        let (clusters, cluster_changes) = reflected(Api::<Cluster>::all(client.clone()));
        let cluster_changes = cluster_changes.predicate_filter(read_fields, Default::default());
        let controller = controller
            .watches_stream(machine_changes.boxed(), move |machine| of_machine(&machine))
            .watches_stream(cluster_changes.boxed(), move |cluster| {
                let (name, namespace) = (cluster.name_any(), cluster.namespace());
                objects
                    .state()
                    .into_iter()
                    .filter(|o| {
                        o.namespace() == namespace
                            && o.labels().get(CLUSTER_NAME_LABEL) == Some(&name)
                    })
                    .map(|o| ObjectRef::from_obj(&*o))
                    .collect::<Vec<_>>()
            });
        (controller, Owners { machines, clusters })
    }

    /// The Machine that owns `object` (its ownerRef), and that Machine's Cluster (the object's
    /// cluster-name label, else the Machine's `spec.clusterName`). `None` until both watches
    /// have listed everything once: before that, a missing owner says nothing.
    pub fn of<K: Resource>(&self, object: &K) -> Option<OwnedBy> {
        if !listed(&self.machines) || !listed(&self.clusters) {
            return None;
        }
        let namespace = object.meta().namespace.clone().unwrap_or_default();
        let owner = owner_machine_ref(object)
            .and_then(|o| self.machines.get(&ObjectRef::new(&o.name).within(&namespace)));
        let cluster_name = object.labels().get(CLUSTER_NAME_LABEL).cloned().or_else(|| {
            owner.as_ref().map(|m| m.spec.cluster_name.clone()).filter(|n| !n.is_empty())
        });
        let cluster = cluster_name
            .and_then(|name| self.clusters.get(&ObjectRef::new(&name).within(&namespace)));
        Some(OwnedBy { machine: owner, cluster })
    }
}

/// A watch of `api` that keeps the store returned and yields every object it touched, once
/// stored: for `Controller::watches_stream`, so a pass the watch wakes reads what woke it.
pub fn reflected<K>(
    api: Api<K>,
) -> (Store<K>, impl Stream<Item = Result<K, watcher::Error>> + Send + 'static)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let changes = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    (store, changes)
}

/// Whether `store`'s watch has listed everything once.
pub fn listed<K>(store: &Store<K>) -> bool
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store.wait_until_ready().now_or_never().is_some_and(|r| r.is_ok())
}

/// A hash of what the provider reads of `object`: its typed fields (the kinds here declare only
/// those) and the metadata the plans look at. Status writes the provider ignores hash the same.
fn read_fields<K: Resource + Serialize>(object: &K) -> Option<u64> {
    let meta = object.meta();
    let mut value = serde_json::to_value(object).ok()?;
    value["metadata"] = json!({
        "labels": meta.labels,
        "annotations": meta.annotations,
        "ownerReferences": meta.owner_references,
        "deletionTimestamp": meta.deletion_timestamp,
    });
    let mut hasher = DefaultHasher::new();
    value.to_string().hash(&mut hasher);
    Some(hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(status: serde_json::Value, resource_version: &str) -> Cluster {
        serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": { "name": "c", "namespace": "n", "resourceVersion": resource_version,
                          "labels": { "a": "b" } },
            "spec": { "controlPlaneEndpoint": { "host": "10.0.0.1", "port": 6443 } },
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn only_a_change_to_what_is_read_wakes_anyone() {
        let before =
            cluster(json!({ "initialization": { "infrastructureProvisioned": true } }), "1");
        // What CAPI writes as each Machine progresses: counts and conditions the provider
        // does not read, with a new resourceVersion.
        let counted = cluster(
            json!({ "initialization": { "infrastructureProvisioned": true },
                    "workers": { "replicas": 7, "readyReplicas": 3 },
                    "conditions": [{ "type": "WorkersAvailable", "status": "False" }] }),
            "2",
        );
        assert_eq!(read_fields(&before), read_fields(&counted));
        let initialized = cluster(
            json!({ "initialization": { "infrastructureProvisioned": true, "controlPlaneInitialized": true } }),
            "3",
        );
        assert_ne!(read_fields(&before), read_fields(&initialized));
        let mut paused = before.clone();
        paused.spec.paused = Some(true);
        assert_ne!(read_fields(&before), read_fields(&paused));
        let mut relabelled = before.clone();
        relabelled.labels_mut().insert("a".into(), "c".into());
        assert_ne!(read_fields(&before), read_fields(&relabelled));
    }
}
