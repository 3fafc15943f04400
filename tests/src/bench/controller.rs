//! The controller benchmark: the provider lab ([`ProviderLab`]: the real kube-apiserver, etcd
//! and Cluster API core controllers, siteboot in Kubernetes mode) with N Hosts, each a
//! simulated machine ([`crate::sim`]) that is inspected and Available before the clock starts;
//! then a MachineDeployment is scaled from 0 to N, and watches on the Hosts, SitebootMachines
//! and Machines time when CAPI has made every SitebootMachine, when every Host is claimed,
//! Provisioned, and when every Machine is Running with its Node.
//!
//! The appliance's requests to the apiserver are counted by the apiserver itself: a FlowSchema
//! made for the run matches only siteboot's ServiceAccount (its priority level is the one the
//! built-in `service-accounts` schema would give it), and `apiserver_flowcontrol_dispatched_
//! requests_total` of that schema is read before and after. Double claims are counted from the
//! watch (every consumer a Host was seen with) and from the final state (every SitebootMachine's
//! `hostRef`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use siteboot_controller::crd::{Host, HostState};
use tokio::sync::mpsc;

use super::{Settings, cpu_seconds, peak_rss_kib, reset_peak_rss};
use crate::provider::{self, ProviderLab, Sims};

/// One scale-up: seconds are from the `replicas` patch.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub hosts: usize,
    /// Until CAPI had made all N SitebootMachines (what siteboot can claim for).
    pub machines_seconds: f64,
    /// Until every Host had a consumer.
    pub claimed_seconds: f64,
    /// From a SitebootMachine's creation to its Host's claim, per machine: p50 and p99 (the
    /// claim rate CAPI's pace of making machines does not set).
    #[serde(default)]
    pub claim_delay_p50_seconds: f64,
    #[serde(default)]
    pub claim_delay_p99_seconds: f64,
    /// Until every Host was Provisioned.
    pub provisioned_seconds: f64,
    /// Until every Machine was Running with a nodeRef.
    pub running_seconds: f64,
    /// siteboot's requests to the management cluster's apiserver, scale to Running.
    pub api_requests: f64,
    pub peak_rss_kib: u64,
    /// siteboot's user + system CPU, scale to Running.
    pub cpu_seconds: f64,
    /// Hosts bound to more than one machine plus machines bound to more than one host.
    pub double_claims: usize,
    /// How long the N Hosts took to be inspected and Available (before the clock).
    pub setup_seconds: f64,
}

const DEPLOYMENT: &str = "bench";
const CLUSTER: &str = "bench";
/// The FlowSchema that counts siteboot's requests.
const FLOW_SCHEMA: &str = "siteboot-bench";

pub fn run(settings: &Settings, _dir: &Path) -> Result<Vec<Sample>> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(scale_up(settings.controller_hosts)).map(|s| vec![s])
}

/// Raises the kernel's ARP table limits for `hosts` simulated hosts if they are lower: every
/// host holds an entry for the appliance and the appliance one for every host, and the table
/// (with its limits, set in the initial namespace only) is shared by all namespaces. At the
/// default `gc_thresh3` of 1,024 it overflowed past about 500 hosts, and hosts stopped booting.
fn neighbor_table_for(hosts: usize) -> Result<()> {
    let wanted = [("gc_thresh2", 2 * hosts + 512), ("gc_thresh3", 4 * hosts + 1024)];
    for (name, wanted) in wanted {
        let path = format!("/proc/sys/net/ipv4/neigh/default/{name}");
        let now: usize = std::fs::read_to_string(&path)?.trim().parse()?;
        if now < wanted {
            eprintln!("controller: raising net.ipv4.neigh.default.{name} from {now} to {wanted}");
            std::fs::write(&path, wanted.to_string()).with_context(|| format!("writing {path}"))?;
        }
    }
    Ok(())
}

/// The lab's DHCP subnet wide enough for `hosts` simulated hosts (the lab's own holds 100), and
/// leases that outlast the run: the simulated hosts do not renew.
fn dhcp_for(config: &mut Value, hosts: usize) {
    config["dhcp"]["lease_time"] = json!("12h");
    if hosts > 100 {
        config["dhcp"]["subnets"][0]["subnet"] = json!("10.99.0.0/21");
        config["dhcp"]["subnets"][0]["pools"] = json!(["10.99.1.0-10.99.7.254"]);
    }
}

async fn scale_up(hosts: usize) -> Result<Sample> {
    if hosts > 1_000 {
        // The lab bridge takes at most 1,024 ports (BR_MAX_PORTS), one per simulated host.
        bail!("at most 1,000 simulated hosts fit on the lab bridge, not {hosts}");
    }
    neighbor_table_for(hosts)?;
    let started = Instant::now();
    eprintln!("controller: starting {hosts} simulated hosts");
    // The idle ramdisks poll as the agent does, not as fast as tests want.
    let sims = Sims { count: hosts, manual: 0 };
    let lab = ProviderLab::start_polling_as_told(sims, |c| dhcp_for(c, hosts))
        .await
        .context("starting the lab with every Host Available")?;
    let setup_seconds = started.elapsed().as_secs_f64();
    eprintln!("controller: {hosts} Hosts Available after {setup_seconds:.0} s");
    let result = measure(&lab, hosts, setup_seconds).await;
    if result.is_err() {
        eprintln!("controller bench: {}", summary(&lab).await);
        eprintln!("----- siteboot log (tail) -----\n{}", tail(&lab.siteboot.log(), 60));
    }
    result
}

async fn measure(lab: &ProviderLab, hosts: usize, setup_seconds: f64) -> Result<Sample> {
    count_requests_of_siteboot(lab).await?;
    lab.create_cluster(CLUSTER, "#cloud-config\n").await?;
    lab.create_template(DEPLOYMENT, provider::LAB_IMAGES[0]).await?;
    lab.create_machine_deployment(DEPLOYMENT, CLUSTER, DEPLOYMENT, 0).await?;
    let pid = lab.siteboot.pid().context("siteboot is not running")?;

    let (events, mut seen) = mpsc::unbounded_channel();
    let watches = [
        tokio::spawn(watch_hosts(lab.hosts(), events.clone())),
        tokio::spawn(watch_machines(lab.api("SitebootMachine"), false, events.clone())),
        tokio::spawn(watch_machines(lab.api("Machine"), true, events)),
    ];
    let _abort = AbortOnDrop(watches);

    reset_peak_rss(pid)?;
    let requests_before = requests_of_siteboot(lab).await?;
    let cpu_before = cpu_seconds(pid);
    let start = Instant::now();
    lab.scale(DEPLOYMENT, hosts as u32).await?;

    let mut progress = Progress::default();
    let deadline = Duration::from_secs(300) + Duration::from_secs(2) * hosts as u32;
    let timed = tokio::time::timeout(deadline, async {
        // A long run says how far it got now and then.
        let mut report = tokio::time::interval(Duration::from_secs(15));
        while !progress.done(hosts) {
            tokio::select! {
                event = seen.recv() => match event {
                    Some(event) => progress.record(event, start.elapsed()),
                    None => bail!("the watches ended"),
                },
                _ = report.tick() => eprintln!(
                    "controller: {:.0} s: {}",
                    start.elapsed().as_secs_f64(),
                    progress.describe(hosts)
                ),
            }
        }
        Ok(())
    })
    .await;
    let running = start.elapsed();
    match timed {
        Ok(result) => result?,
        Err(_) => bail!("not done after {deadline:?}: {}", progress.describe(hosts)),
    }
    let cpu = cpu_seconds(pid) - cpu_before;
    let api_requests = requests_of_siteboot(lab).await? - requests_before;
    let peak_rss_kib = peak_rss_kib(pid)?;
    let double_claims = double_claims(lab, &progress).await?;
    let mut delays = progress.claim_delays();
    delays.sort_by(f64::total_cmp);
    let at = |times: &BTreeMap<String, Duration>| {
        times.values().max().map_or(0.0, Duration::as_secs_f64)
    };
    Ok(Sample {
        hosts,
        machines_seconds: at(&progress.created),
        claimed_seconds: at(&progress.claimed),
        claim_delay_p50_seconds: super::percentile(&delays, 0.5),
        claim_delay_p99_seconds: super::percentile(&delays, 0.99),
        provisioned_seconds: at(&progress.provisioned),
        running_seconds: running.as_secs_f64(),
        api_requests,
        peak_rss_kib,
        cpu_seconds: cpu,
        double_claims,
        setup_seconds,
    })
}

/// What a watch saw of one object.
enum Seen {
    Host { name: String, consumer: Option<String>, provisioned: bool },
    SitebootMachine { name: String, uid: String },
    Machine { name: String, running: bool },
}

/// When each object first reached each milestone, and every Host's consumers.
#[derive(Default)]
struct Progress {
    created: BTreeMap<String, Duration>,
    /// SitebootMachine uid -> when it appeared.
    created_uid: BTreeMap<String, Duration>,
    /// SitebootMachine uid -> when a Host was first seen claimed for it.
    claimed_for: BTreeMap<String, Duration>,
    claimed: BTreeMap<String, Duration>,
    provisioned: BTreeMap<String, Duration>,
    running: BTreeMap<String, Duration>,
    /// Host -> the uids of every SitebootMachine it was seen claimed for.
    consumers: BTreeMap<String, BTreeSet<String>>,
}

impl Progress {
    fn record(&mut self, seen: Seen, at: Duration) {
        match seen {
            Seen::Host { name, consumer, provisioned } => {
                if let Some(consumer) = consumer {
                    self.claimed.entry(name.clone()).or_insert(at);
                    self.claimed_for.entry(consumer.clone()).or_insert(at);
                    self.consumers.entry(name.clone()).or_default().insert(consumer);
                }
                if provisioned {
                    self.provisioned.entry(name).or_insert(at);
                }
            }
            Seen::SitebootMachine { name, uid } => {
                self.created.entry(name).or_insert(at);
                self.created_uid.entry(uid).or_insert(at);
            }
            Seen::Machine { name, running } => {
                if running {
                    self.running.entry(name).or_insert(at);
                }
            }
        }
    }

    /// Seconds from each SitebootMachine's appearance to its Host's claim.
    fn claim_delays(&self) -> Vec<f64> {
        self.claimed_for
            .iter()
            .filter_map(|(uid, claimed)| {
                let created = self.created_uid.get(uid)?;
                Some(claimed.saturating_sub(*created).as_secs_f64())
            })
            .collect()
    }

    fn done(&self, hosts: usize) -> bool {
        self.created.len() >= hosts
            && self.claimed.len() >= hosts
            && self.provisioned.len() >= hosts
            && self.running.len() >= hosts
    }

    fn describe(&self, hosts: usize) -> String {
        format!(
            "of {hosts}: {} SitebootMachines made, {} Hosts claimed, {} Provisioned, {} Machines Running",
            self.created.len(),
            self.claimed.len(),
            self.provisioned.len(),
            self.running.len()
        )
    }
}

async fn watch_hosts(api: Api<Host>, events: mpsc::UnboundedSender<Seen>) -> Result<()> {
    let mut stream = watcher(api, watcher::Config::default()).applied_objects().boxed();
    while let Some(host) = stream.next().await {
        let host = host?;
        let state = host.status.as_ref().and_then(|s| s.state);
        let seen = Seen::Host {
            name: host.name_any(),
            consumer: host.spec.consumer_ref.map(|c| c.uid),
            provisioned: state == Some(HostState::Provisioned),
        };
        if events.send(seen).is_err() {
            break;
        }
    }
    Ok(())
}

/// SitebootMachines as they appear, or (`machines`) Machines as they are Running with a Node.
async fn watch_machines(
    api: Api<DynamicObject>,
    machines: bool,
    events: mpsc::UnboundedSender<Seen>,
) -> Result<()> {
    let mut stream = watcher(api, watcher::Config::default()).applied_objects().boxed();
    while let Some(object) = stream.next().await {
        let object = object?;
        let name = object.name_any();
        let seen = if machines {
            let status = &object.data["status"];
            let running = status["phase"] == "Running" && status["nodeRef"]["name"].is_string();
            Seen::Machine { name, running }
        } else {
            Seen::SitebootMachine { name, uid: object.uid().unwrap_or_default() }
        };
        if events.send(seen).is_err() {
            break;
        }
    }
    Ok(())
}

struct AbortOnDrop([tokio::task::JoinHandle<Result<()>>; 3]);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Hosts bound to more than one SitebootMachine (over the whole run, from the watch, and by the
/// machines' `hostRef` at the end) plus SitebootMachines bound to more than one Host.
async fn double_claims(lab: &ProviderLab, progress: &Progress) -> Result<usize> {
    let mut machines_of: BTreeMap<String, BTreeSet<String>> = progress.consumers.clone();
    for host in lab.hosts().list(&ListParams::default()).await? {
        if let Some(c) = &host.spec.consumer_ref {
            machines_of.entry(host.name_any()).or_default().insert(c.uid.clone());
        }
    }
    for machine in lab.api("SitebootMachine").list(&ListParams::default()).await? {
        if let Some(host) = machine.data["spec"]["hostRef"]["name"].as_str() {
            let uid = machine.uid().unwrap_or_default();
            machines_of.entry(host.to_owned()).or_default().insert(uid);
        }
    }
    let mut hosts_of: BTreeMap<&str, usize> = BTreeMap::new();
    for machine in machines_of.values().flatten() {
        *hosts_of.entry(machine).or_default() += 1;
    }
    let shared_hosts = machines_of.values().filter(|m| m.len() > 1).count();
    let split_machines = hosts_of.values().filter(|n| **n > 1).count();
    Ok(shared_hosts + split_machines)
}

/// A FlowSchema that matches siteboot's ServiceAccount alone, ahead of the built-in
/// `service-accounts` schema and on the same priority level, so the apiserver counts its
/// requests apart and serves them as it otherwise would.
async fn count_requests_of_siteboot(lab: &ProviderLab) -> Result<()> {
    let schema: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
        "metadata": { "name": FLOW_SCHEMA },
        "spec": {
            "matchingPrecedence": 500,
            "priorityLevelConfiguration": { "name": "workload-low" },
            "distinguisherMethod": { "type": "ByUser" },
            "rules": [{
                "subjects": [{ "kind": "ServiceAccount", "serviceAccount": { "namespace": provider::SYSTEM_NS, "name": "siteboot" } }],
                "resourceRules": [{ "verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"], "clusterScope": true }],
                "nonResourceRules": [{ "verbs": ["*"], "nonResourceURLs": ["*"] }],
            }],
        },
    }))?;
    let api = lab.management().api("flowcontrol.apiserver.k8s.io/v1", "FlowSchema", None);
    api.create(&PostParams::default(), &schema).await?;
    Ok(())
}

/// The requests the apiserver dispatched for siteboot's ServiceAccount so far.
async fn requests_of_siteboot(lab: &ProviderLab) -> Result<f64> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = lab.management().client().request_text(request).await?;
    let metric = "apiserver_flowcontrol_dispatched_requests_total{";
    let schema = format!("flow_schema=\"{FLOW_SCHEMA}\"");
    Ok(crate::appliance::Metrics::parse(&text)
        .0
        .iter()
        .filter(|(series, _)| series.starts_with(metric) && series.contains(&schema))
        .map(|(_, value)| value)
        .sum())
}

/// Hosts by state and Machines by phase, for a run that did not finish.
async fn summary(lab: &ProviderLab) -> String {
    let mut states: BTreeMap<String, usize> = BTreeMap::new();
    for state in lab.host_states().await.unwrap_or_default().values() {
        *states.entry(format!("{state:?}")).or_default() += 1;
    }
    let mut phases: BTreeMap<String, usize> = BTreeMap::new();
    for m in
        lab.api("Machine").list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default()
    {
        *phases.entry(m.data["status"]["phase"].as_str().unwrap_or("-").to_owned()).or_default() +=
            1;
    }
    format!("Hosts by state {states:?}, Machines by phase {phases:?}")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
