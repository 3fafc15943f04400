//! `clusterctl move` of a cluster whose Machines run on Provisioned hosts, between two real
//! management clusters: two `KubeEnv`s (apiserver + etcd + the Cluster API core manager each),
//! siteboot installed on both by `clusterctl init` from the release folder the binary under test
//! writes (`tests/src/kube/clusterctl.rs`), the provider lab's appliance and simulated hosts
//! (`tests/src/provider.rs`, `tests/src/sim.rs`) provisioning a MachineDeployment on the
//! source. Then the peers' `clusterctl move`, and the same appliance (same configuration, state
//! directory and hosts) pointed at the target. The source's apiserver stays the workload
//! cluster (the Nodes), as a workload cluster stays where it is when its management moves.
//!
//! A watch on each side records every state each Host is seen in, so a host that went through
//! Registering, Inspecting, Provisioning or Deprovisioning for a moment cannot hide; the
//! simulated hosts count their boots and the bootstrap data their ramdisk fetched.
//!
//! Failures panic while everything is alive, so the logs of siteboot, the simulated hosts and
//! both environments' components are printed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use siteboot_controller::crd::{Host, HostState};
use siteboot_tests::kube::KubeEnv;
use siteboot_tests::kube::capi::{CAPI, CONTROL_PLANE, TEST_CONTROL_PLANE_CRD, wait_object};
use siteboot_tests::kube::clusterctl::Clusterctl;
use siteboot_tests::provider::{NS, ProviderLab, Sims};
use siteboot_tests::sim::{Phase, SimHost};
use siteboot_tests::wait;

const ROLLOUT: Duration = Duration::from_secs(300);
const CLUSTER: &str = "c1";
const DEPLOYMENT: &str = "workers";
const MACHINES: usize = 2;
const PAUSED: &str = "cluster.x-k8s.io/paused";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clusterctl_move_keeps_hosts_provisioned_and_bound_and_a_paused_host_is_not_claimed() {
    let dir = tempfile::tempdir().unwrap();
    let (source, target) = tokio::try_join!(KubeEnv::start(), KubeEnv::start())
        .expect("starting two management clusters side by side");
    let source_ctl = Clusterctl::install_siteboot(&source, &dir.path().join("source"))
        .await
        .expect("clusterctl init on the source");
    Clusterctl::install_siteboot(&target, &dir.path().join("target"))
        .await
        .expect("clusterctl init on the target");
    // Two hosts for the Machines and a spare, which the pause part uses.
    let sims = Sims { count: MACHINES + 1, manual: 0 };
    let mut lab = ProviderLab::start_on(source, sims, |_| {}).await.unwrap();
    if let Err(err) = steps(&mut lab, target, &source_ctl).await {
        panic!("{err:#}\n{}", lab.describe().await);
    }
}

/// A SitebootMachine as it was before the move.
#[derive(Debug)]
struct Machine {
    name: String,
    uid: String,
    provider_id: String,
    host: String,
}

/// What a host's simulated machine has done so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    boots: u32,
    bootstrap_fetches: usize,
}

fn counts(sim: &SimHost) -> Counts {
    Counts { boots: sim.boots(), bootstrap_fetches: sim.bootstrap_data().len() }
}

async fn steps(lab: &mut ProviderLab, target: KubeEnv, source_ctl: &Clusterctl) -> Result<()> {
    lab.create_cluster(CLUSTER, "#cloud-config\nhostname: moved\n").await?;
    own_bootstrap_secret(lab).await?;
    lab.create_template("workers-v1", "v1").await?;
    lab.create_machine_deployment(DEPLOYMENT, CLUSTER, "workers-v1", MACHINES as u32).await?;
    lab.wait_running(DEPLOYMENT, MACHINES, ROLLOUT).await?;
    lab.wait_hosts(HostState::Provisioned, MACHINES, ROLLOUT).await?;
    lab.wait_hosts(HostState::Available, 1, ROLLOUT).await?;

    // The test control plane goes along too (clusterctl moves the kinds of CRDs with its label).
    let control_plane_crd = movable_test_control_plane_crd()?;
    lab.env.install_crd(&control_plane_crd).await?;
    target.install_crd(&control_plane_crd).await?;

    let before = machines(lab).await?;
    ensure!(before.len() == MACHINES, "{before:?}");
    let hosts = lab.hosts();
    let mut installed = BTreeMap::new();
    for machine in &before {
        let host = hosts.get(&machine.host).await?;
        let consumer = host.spec.consumer_ref.clone().context("a claimed host")?;
        ensure!(consumer.uid == machine.uid, "{machine:?} and {consumer:?}");
        let status = host.status.clone().unwrap_or_default();
        installed.insert(machine.host.clone(), status.installed.context("an image")?.image);
    }
    let spare = hosts
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|h| h.name_any())
        .find(|name| !installed.contains_key(name))
        .context("the spare host")?;
    let sims = sims_by_host(lab).await?;
    let counts_before: BTreeMap<&String, Counts> =
        sims.iter().map(|(host, sim)| (host, counts(sim))).collect();
    let mut scripts = BTreeMap::new();
    for machine in &before {
        let script = boot_script(&sims[&machine.host])?;
        let exits = script.lines().any(|l| l.split_whitespace().next() == Some("exit"));
        ensure!(exits, "not the local disk:\n{script}");
        scripts.insert(machine.host.clone(), script);
    }

    // One claimed host is paused before the move (what an operator may do to be safe).
    let paused = &before[1].host;
    hosts.patch(paused, &PatchParams::default(), &pause(json!(""))).await?;

    let source_watch = HostWatch::start(lab.hosts()).await?;
    let target_watch = HostWatch::start(Api::namespaced(target.client(), NS)).await?;

    // The real move, with the source's appliance running.
    let target_kubeconfig = target.kubeconfig_path().display().to_string();
    let moved = source_ctl.run(&mut source_ctl.command(&[
        "move",
        "--to-kubeconfig",
        &target_kubeconfig,
        "--namespace",
        NS,
    ]))?;
    ensure!(moved.status.success(), "clusterctl move failed");

    // The source let everything go and touched nothing.
    ensure!(lab.hosts().list(&ListParams::default()).await?.items.is_empty(), "Hosts left");
    for kind in ["SitebootMachine", "Machine", "Cluster"] {
        let left = lab.api(kind).list(&ListParams::default()).await?.items;
        ensure!(left.is_empty(), "{} {kind}s left on the source", left.len());
    }
    let seen = wait::for_async("the source's watch to see every Host deleted", ROLLOUT, || async {
        let seen = source_watch.seen();
        let deleted = seen.values().filter(|s| s.last() == Some(&Seen::Deleted)).count();
        (deleted == MACHINES + 1).then_some(seen)
    })
    .await?;
    for (host, states) in &seen {
        let state = if installed.contains_key(host) {
            HostState::Provisioned
        } else {
            HostState::Available
        };
        ensure!(
            states.first() == Some(&Seen::State(Some(state)))
                && states.last() == Some(&Seen::Deleted)
                && states.len() == 2,
            "on the source, Host {host} was {states:?}: it must stay {state:?} until deleted"
        );
    }
    ensure!(seen.len() == MACHINES + 1, "the source's watch saw {seen:?}");
    for (host, sim) in &sims {
        ensure!(counts(sim) == counts_before[host], "{host}'s machine was touched by the move");
    }

    // The target: the control plane provider reports its (hosted) control plane again, as it
    // would after a move, and the same appliance now works there.
    let control_planes = target.api(CONTROL_PLANE, "TestControlPlane", Some(NS));
    let status = json!({ "status": {
        "initialization": { "controlPlaneInitialized": true },
        "externalManagedControlPlane": true,
    }});
    control_planes.patch_status(CLUSTER, &PatchParams::default(), &Patch::Merge(status)).await?;
    lab.move_to(target).await?;

    // The paused host arrives paused and without status: it is not rebuilt while paused, yet it
    // boots its disk, not the ramdisk (which would stop its workload).
    let claimed: Vec<&String> = installed.keys().collect();
    let hosts = lab.hosts();
    wait::for_async("the paused Host to report Paused=True, with no state", ROLLOUT, || async {
        if let Err(e) = stayed_provisioned(&target_watch, &claimed) {
            return Some(Err(e));
        }
        let host = hosts.get(paused).await.ok()?;
        (is_paused(&host) && host.status.as_ref().and_then(|s| s.state).is_none()).then_some(Ok(()))
    })
    .await??;
    reboots_to_its_disk(paused, &sims[paused]).await?;
    hosts.patch(paused, &PatchParams::default(), &pause(Value::Null)).await?;

    let sbms = lab.api("SitebootMachine");
    let after =
        wait::for_async("every SitebootMachine Ready again on the target", ROLLOUT, || async {
            if let Err(e) = stayed_provisioned(&target_watch, &claimed) {
                return Some(Err(e));
            }
            let list = sbms.list(&ListParams::default()).await.ok()?.items;
            let ready = list.iter().filter(|m| ready(m)["status"] == "True").count();
            (list.len() == MACHINES && ready == MACHINES).then_some(Ok(list))
        })
        .await??;
    for machine in &before {
        let sbm = after.iter().find(|m| m.name_any() == machine.name).context("moved")?;
        let uid = sbm.uid().context("a uid")?;
        ensure!(uid != machine.uid, "{} has the source's uid", machine.name);
        ensure!(sbm.data["spec"]["providerID"] == json!(machine.provider_id), "{:?}", sbm.data);
        ensure!(sbm.data["spec"]["hostRef"]["name"] == json!(machine.host), "{:?}", sbm.data);
        ensure!(ready(sbm)["reason"] == "Provisioned", "{}", ready(sbm));
        let host = lab.hosts().get(&machine.host).await?;
        let consumer = host.spec.consumer_ref.clone().context("still claimed")?;
        ensure!(
            (consumer.name.as_str(), consumer.uid.as_str()) == (machine.name.as_str(), &uid),
            "Host {} names {consumer:?}, not the moved {} ({uid})",
            machine.host,
            machine.name
        );
        let status = host.status.unwrap_or_default();
        ensure!(status.state == Some(HostState::Provisioned), "{status:?}");
        let image = status.installed.context("installed image kept")?.image;
        ensure!(image == installed[&machine.host], "{image:?}");
    }
    let running = lab.wait_running(DEPLOYMENT, MACHINES, ROLLOUT).await?;
    for machine in &running {
        let infra = machine.data["spec"]["infrastructureRef"]["name"].as_str().unwrap_or("");
        let was = before.iter().find(|m| m.name == infra).context("the same machines")?;
        ensure!(machine.data["spec"]["providerID"] == json!(was.provider_id));
    }

    // The same boot decisions: the local disk; a host that reboots boots it again.
    for (host, script) in &scripts {
        ensure!(boot_script(&sims[host])? == *script, "{host}'s boot script changed");
    }
    let rebooted = &before[0].host;
    reboots_to_its_disk(rebooted, &sims[rebooted]).await?;
    stayed_provisioned(&target_watch, &claimed)?;
    for (host, sim) in &sims {
        let mut expected = counts_before[host];
        if host == rebooted || host == paused {
            expected.boots += 1;
        }
        if host != &spare {
            ensure!(counts(sim) == expected, "{host} was {:?}, now {:?}", expected, counts(sim));
        }
    }

    pause_stops_a_claim(lab, &spare, &sims[&spare]).await?;
    stayed_provisioned(&target_watch, &claimed)
}

/// On the target: the spare host, paused once it is Available again, is not claimed for a new
/// Machine; without the annotation it is, and provisioned.
async fn pause_stops_a_claim(lab: &ProviderLab, spare: &str, sim: &SimHost) -> Result<()> {
    // A moved Host that was not Provisioned is wiped before it is Available again: its record
    // cannot prove the disk is clean.
    lab.wait_hosts(HostState::Available, 1, ROLLOUT).await?;
    let hosts = lab.hosts();
    hosts.patch(spare, &PatchParams::default(), &pause(json!(""))).await?;
    wait_object(&hosts, spare, "Paused=True", ROLLOUT, is_paused).await?;

    lab.scale(DEPLOYMENT, MACHINES as u32 + 1).await?;
    let sbms = lab.api("SitebootMachine");
    let waiting = wait::for_async("the new machine to find no host", ROLLOUT, || async {
        let list = sbms.list(&ListParams::default()).await.ok()?.items;
        list.into_iter().find(|m| ready(m)["reason"] == "NoHostAvailable")
    })
    .await?;
    let message = ready(&waiting)["message"].as_str().unwrap_or_default().to_owned();
    ensure!(message.contains("1 paused"), "{message}");
    let host = hosts.get(spare).await?;
    ensure!(host.spec.consumer_ref.is_none(), "the paused host was claimed: {:?}", host.spec);
    ensure!(sim.bootstrap_data().is_empty(), "the paused host got bootstrap data");

    hosts.patch(spare, &PatchParams::default(), &pause(Value::Null)).await?;
    lab.wait_running(DEPLOYMENT, MACHINES + 1, ROLLOUT).await?;
    let host = hosts.get(spare).await?;
    let consumer = host.spec.consumer_ref.context("claimed once unpaused")?;
    ensure!(consumer.uid == waiting.uid().unwrap_or_default(), "{consumer:?}");
    ensure!(sim.bootstrap_data().len() == 1, "{:?}", sim.bootstrap_data());
    Ok(())
}

/// Makes the Cluster the owner of its bootstrap Secret, so `clusterctl move` takes it along
/// (a bootstrap provider's data Secret is owned by its config, which the Machine owns; this
/// one, shared by the MachineDeployment's Machines, has no such owner).
async fn own_bootstrap_secret(lab: &ProviderLab) -> Result<()> {
    let cluster = lab.api("Cluster").get(CLUSTER).await?;
    let owner = json!({
        "apiVersion": CAPI, "kind": "Cluster", "name": CLUSTER, "uid": cluster.uid(),
    });
    let patch = json!({ "metadata": { "ownerReferences": [owner] } });
    Api::<Secret>::namespaced(lab.env.client(), NS)
        .patch(&format!("{CLUSTER}-bootstrap"), &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

/// A merge patch setting the paused annotation to `value` (null removes it).
fn pause(value: Value) -> Patch<Value> {
    Patch::Merge(json!({ "metadata": { "annotations": { PAUSED: value } } }))
}

/// Whether the appliance reports the Host paused.
fn is_paused(host: &Host) -> bool {
    let conditions = host.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    conditions.iter().any(|c| c.type_ == "Paused" && c.status == "True")
}

/// Power-cycles `host`'s machine and checks that it boots its disk again, not the ramdisk.
async fn reboots_to_its_disk(host: &str, sim: &SimHost) -> Result<()> {
    let boots = sim.boots() + 1;
    sim.reboot();
    let phase = wait::for_async(&format!("{host} to boot again"), ROLLOUT, || async {
        let phase = sim.phase();
        (sim.boots() == boots && phase != Phase::Booting).then_some(phase)
    })
    .await?;
    ensure!(phase == Phase::Os, "{host} booted into {phase:?}, not its disk");
    Ok(())
}

/// The SitebootMachines, with the hosts they are bound to.
async fn machines(lab: &ProviderLab) -> Result<Vec<Machine>> {
    let list = lab.api("SitebootMachine").list(&ListParams::default()).await?.items;
    list.iter()
        .map(|m| {
            let text =
                |pointer: &str| m.data.pointer(pointer).and_then(Value::as_str).map(str::to_owned);
            Ok(Machine {
                name: m.name_any(),
                uid: m.uid().context("a uid")?,
                provider_id: text("/spec/providerID").context("a providerID")?,
                host: text("/spec/hostRef/name").context("a hostRef")?,
            })
        })
        .collect()
}

/// Each Host's simulated machine, by Host name.
async fn sims_by_host(lab: &ProviderLab) -> Result<BTreeMap<String, Arc<SimHost>>> {
    let sims = lab.sims();
    let mut by_host = BTreeMap::new();
    for host in lab.hosts().list(&ListParams::default()).await?.items {
        let sim = sims.iter().find(|s| s.mac() == host.spec.boot_mac_address);
        by_host.insert(host.name_any(), sim.context("a simulated machine")?.clone());
    }
    Ok(by_host)
}

/// The boot script the appliance serves the host now, asked for from its own address.
fn boot_script(sim: &SimHost) -> Result<String> {
    let path = format!("/boot/{}.ipxe", sim.mac().replace(':', "-"));
    match sim.http("GET", &path, None, None)? {
        (200, script) => Ok(script),
        (status, body) => bail!("GET {path}: {status} {body}"),
    }
}

fn ready(object: &DynamicObject) -> Value {
    object.data["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready").cloned())
        .unwrap_or_default()
}

/// The TestControlPlane CRD with clusterctl's label, which `clusterctl init` would have put on
/// a real control plane provider's CRDs.
fn movable_test_control_plane_crd() -> Result<Value> {
    let mut crd: Value = serde_norway::from_str(TEST_CONTROL_PLANE_CRD)?;
    crd["metadata"]["labels"]["clusterctl.cluster.x-k8s.io"] = json!("");
    Ok(crd)
}

/// Fails if one of `hosts`, as the target's watch saw it, was ever in a state but Provisioned
/// (after having none: `clusterctl move` creates a Host without status) or was deleted.
fn stayed_provisioned(watch: &HostWatch, hosts: &[&String]) -> Result<()> {
    let seen = watch.seen();
    for host in hosts {
        let states = seen.get(*host).map(Vec::as_slice).unwrap_or_default();
        let after_creation = match states {
            [Seen::State(None), rest @ ..] => rest,
            all => all,
        };
        if after_creation.iter().any(|s| *s != Seen::State(Some(HostState::Provisioned))) {
            bail!("on the target, Host {host} went through {states:?}: it must stay Provisioned");
        }
    }
    Ok(())
}

/// A state a Host was seen in (`None`: none yet), or its deletion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    State(Option<HostState>),
    Deleted,
}

/// Every state each Host of a namespace is seen in, by a watch (its changes, in order).
struct HostWatch {
    seen: Arc<Mutex<BTreeMap<String, Vec<Seen>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl HostWatch {
    /// Starts watching; returns once the watch has listed what exists.
    async fn start(api: Api<Host>) -> Result<Self> {
        let seen: Arc<Mutex<BTreeMap<String, Vec<Seen>>>> = Arc::default();
        let listed = Arc::new(AtomicBool::new(false));
        let (record, done) = (seen.clone(), listed.clone());
        let task = tokio::spawn(async move {
            let note = |host: &Host, what: Seen| {
                let mut seen = record.lock().unwrap();
                let states = seen.entry(host.name_any()).or_default();
                if states.last() != Some(&what) {
                    states.push(what);
                }
            };
            let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(h) | watcher::Event::InitApply(h)) => {
                        note(&h, Seen::State(h.status.as_ref().and_then(|s| s.state)));
                    }
                    Ok(watcher::Event::Delete(h)) => note(&h, Seen::Deleted),
                    Ok(watcher::Event::InitDone) => done.store(true, Ordering::Release),
                    Ok(watcher::Event::Init) | Err(_) => {}
                }
            }
        });
        let watch = Self { seen, task };
        wait::for_async("the Host watch to list", Duration::from_secs(30), || async {
            listed.load(Ordering::Acquire).then_some(())
        })
        .await?;
        Ok(watch)
    }

    fn seen(&self) -> BTreeMap<String, Vec<Seen>> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for HostWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
