//! The SitebootMachineTemplate reconciler: a template's `status.capacity` and `status.nodeInfo`,
//! which the cluster autoscaler reads to scale a MachineDeployment up from zero machines.
//!
//! Every site's appliance runs it over every Host of the template's host namespace, whatever
//! their site: a template is not tied to a site, and appliances that look at the same Hosts
//! write the same status instead of taking turns.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use crate::context::{Ctx, Error, Reconciled, Requeue};
use crate::crd::{
    Architecture, Host, NodeInfo, SitebootMachineTemplate, SitebootMachineTemplateStatus,
};
use crate::owners;
use crate::selection;

/// What the installed OS is: siteboot's images boot with a cloud-init (NoCloud) seed and run
/// a Linux kubelet.
const OPERATING_SYSTEM: &str = "linux";

/// The status of `template` given `hosts`: over the inspected Hosts of its host namespace that
/// its `hostSelector` matches (in any state: capacity says what a machine of the template is,
/// not whether one is free now), the fewest CPUs and the least memory any of them has, and
/// their architecture if they share one. No such Host: an empty status, so the autoscaler
/// promises nothing.
pub fn status<'a>(
    template: &SitebootMachineTemplate,
    hosts: impl IntoIterator<Item = &'a Host>,
) -> SitebootMachineTemplateStatus {
    let namespace = host_namespace(template);
    let selector = template.spec.template.spec.host_selector.clone().unwrap_or_default();
    let matching = hosts.into_iter().filter(|h| {
        h.namespace().as_deref() == Some(namespace.as_str())
            && h.metadata.deletion_timestamp.is_none()
            && selection::selected(h, &selector).is_ok()
    });
    let mut least: Option<(u32, u64)> = None;
    let mut architectures = Vec::new();
    for hardware in matching.filter_map(|h| h.status.as_ref()?.hardware.as_ref()) {
        least = Some(match least {
            Some((cpus, mib)) => (cpus.min(hardware.cpus), mib.min(hardware.memory_mib)),
            None => (hardware.cpus, hardware.memory_mib),
        });
        architectures.push(hardware.arch.as_deref().and_then(Architecture::from_kernel_name));
    }
    let Some((cpus, mib)) = least else { return SitebootMachineTemplateStatus::default() };
    architectures.dedup();
    SitebootMachineTemplateStatus {
        capacity: BTreeMap::from([
            ("cpu".to_owned(), Quantity(cpus.to_string())),
            ("memory".to_owned(), Quantity(format!("{mib}Mi"))),
        ]),
        node_info: Some(NodeInfo {
            architecture: match architectures[..] {
                [one] => one,
                _ => None,
            },
            operating_system: Some(OPERATING_SYSTEM.to_owned()),
        }),
    }
}

/// Where the template's machines look for Hosts, as a SitebootMachine made from it would.
fn host_namespace(template: &SitebootMachineTemplate) -> String {
    template.spec.template.spec.host_namespace(template.namespace())
}

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let client = ctx.client.clone();
    let controller = Controller::new(
        Api::<SitebootMachineTemplate>::all(client.clone()),
        watcher::Config::default(),
    );
    let templates = controller.store();
    // Every Host, whatever its site, kept by the watch that wakes the templates: a pass reads
    // the Hosts from here (written before the watch wakes it) rather than listing them all.
    let (hosts, host_changes) = owners::reflected(Api::<Host>::all(client));
    let controller = controller
        .watches_stream(host_changes.boxed(), move |host| templates_for_host(&host, &templates));
    let hosts = Arc::new(hosts);
    ctx.drive(controller, shutdown, move |template, ctx| {
        let hosts = hosts.clone();
        async move { pass(&template, &ctx, &hosts).await }
    })
    .await;
}

/// A Host change may change the capacity of every template that looks in its namespace.
fn templates_for_host(
    host: &Host,
    store: &Store<SitebootMachineTemplate>,
) -> Vec<ObjectRef<SitebootMachineTemplate>> {
    store
        .state()
        .into_iter()
        .filter(|t| host.namespace() == Some(host_namespace(t)))
        .map(|t| ObjectRef::from_obj(&*t))
        .collect()
}

impl Reconciled for SitebootMachineTemplate {}

async fn pass(
    template: &SitebootMachineTemplate,
    ctx: &Ctx,
    hosts: &Store<Host>,
) -> Result<Action, Error> {
    if !owners::listed(hosts) {
        return Ok(Action::requeue(owners::NOT_LISTED_RETRY));
    }
    let namespace = Some(host_namespace(template));
    let hosts = hosts.state();
    let status =
        status(template, hosts.iter().map(|h| &**h).filter(|h| h.namespace() == namespace));
    if template.status.clone().unwrap_or_default() != status {
        // The whole status, with the resourceVersion read: a field that no longer applies goes
        // away, and a conflict is retried from a fresh read.
        let mut updated = template.clone();
        updated.status = Some(status);
        let api: Api<SitebootMachineTemplate> =
            Api::namespaced(ctx.client.clone(), &template.namespace().unwrap_or_default());
        api.replace_status(&template.name_any(), &PostParams::default(), &updated).await?;
    }
    Ok(Requeue::OnChange.into())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;
    use crate::crd::{
        Hardware, HardwareSelector, HostSelector, HostSpec, HostState, HostStatus, Image,
        SitebootMachineSpec, SitebootMachineTemplateResource, SitebootMachineTemplateSpec,
    };

    fn template(selector: Option<HostSelector>) -> SitebootMachineTemplate {
        let spec = SitebootMachineSpec {
            provider_id: None,
            host_selector: selector,
            image: Image {
                url: "http://x/os.raw".into(),
                checksum: "sha256:00".into(),
                format: None,
                grow_last_partition: false,
            },
            wipe: None,
            host_ref: None,
        };
        let mut t = SitebootMachineTemplate::new(
            "workers",
            SitebootMachineTemplateSpec {
                template: SitebootMachineTemplateResource { metadata: None, spec },
            },
        );
        t.metadata.namespace = Some("metal".into());
        t
    }

    fn host(name: &str, cpus: u32, memory_mib: u64, arch: &str) -> Host {
        let mut h = Host::new(name, HostSpec::new("52:54:00:00:00:01"));
        h.metadata.namespace = Some("metal".into());
        h.metadata.labels = Some(BTreeMap::from([("pool".to_owned(), "big".to_owned())]));
        h.status = Some(HostStatus {
            state: Some(HostState::Provisioned),
            hardware: Some(Hardware {
                cpus,
                memory_mib,
                arch: Some(arch.into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        h
    }

    fn capacity(status: &SitebootMachineTemplateStatus) -> Vec<(&str, &str)> {
        status.capacity.iter().map(|(k, v)| (k.as_str(), v.0.as_str())).collect()
    }

    #[test]
    fn the_least_of_each_resource_among_matching_hosts_is_promised() {
        let hosts = [host("a", 16, 65536, "x86_64"), host("b", 8, 131072, "x86_64")];
        let status = status(&template(None), &hosts);
        assert_eq!(capacity(&status), [("cpu", "8"), ("memory", "65536Mi")]);
        let info = status.node_info.unwrap();
        assert_eq!(info.architecture, Some(Architecture::Amd64));
        assert_eq!(info.operating_system.as_deref(), Some("linux"));
        let yaml = serde_json::to_value(status.capacity).unwrap();
        assert_eq!(yaml, serde_json::json!({ "cpu": "8", "memory": "65536Mi" }));
    }

    #[test]
    fn only_inspected_hosts_the_selector_matches_in_its_namespace_count() {
        let mut other_label = host("small-other-pool", 1, 1024, "x86_64");
        other_label.metadata.labels = None;
        let mut other_namespace = host("small-elsewhere", 1, 1024, "x86_64");
        other_namespace.metadata.namespace = Some("lab".into());
        let mut deleting = host("small-deleting", 1, 1024, "x86_64");
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        let mut uninspected = host("new", 0, 0, "x86_64");
        uninspected.status.as_mut().unwrap().hardware = None;
        let too_small = host("too-small", 2, 2048, "x86_64");
        let big = host("big", 32, 262144, "aarch64");
        let hosts = [other_label, other_namespace, deleting, uninspected, too_small, big];
        let selector = HostSelector {
            match_labels: BTreeMap::from([("pool".to_owned(), "big".to_owned())]),
            hardware: Some(HardwareSelector { min_cpus: Some(4), ..Default::default() }),
            namespace: None,
        };
        let status = status(&template(Some(selector.clone())), &hosts);
        assert_eq!(capacity(&status), [("cpu", "32"), ("memory", "262144Mi")]);
        assert_eq!(status.node_info.unwrap().architecture, Some(Architecture::Arm64));

        // The selector's namespace, not the template's.
        let elsewhere = HostSelector { namespace: Some("lab".into()), ..Default::default() };
        let status = super::status(&template(Some(elsewhere)), &hosts);
        assert_eq!(capacity(&status), [("cpu", "1"), ("memory", "1024Mi")]);
    }

    #[test]
    fn no_matching_host_promises_nothing_and_mixed_architectures_name_none() {
        let none = HostSelector {
            match_labels: BTreeMap::from([("pool".to_owned(), "gpu".to_owned())]),
            ..Default::default()
        };
        let hosts = [host("a", 4, 8192, "x86_64"), host("b", 4, 8192, "aarch64")];
        assert_eq!(status(&template(Some(none)), &hosts), SitebootMachineTemplateStatus::default());
        assert_eq!(status(&template(None), &[]), SitebootMachineTemplateStatus::default());
        let mixed = status(&template(None), &hosts);
        assert_eq!(capacity(&mixed), [("cpu", "4"), ("memory", "8192Mi")]);
        assert_eq!(mixed.node_info.unwrap().architecture, None);
        let unknown = [host("r", 4, 8192, "riscv64")];
        assert_eq!(status(&template(None), &unknown).node_info.unwrap().architecture, None);
    }
}
