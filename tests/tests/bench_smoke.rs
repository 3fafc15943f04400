//! The benchmark driver (`scripts/bench`) in seconds: every benchmark with tiny sizes and one
//! run, against every peer. It checks that the driver ran and wrote a well-formed table with
//! every server in it; it never judges a speed (speeds are published, not asserted).

use std::process::Command;

use siteboot_tests::bench::report::{BEGIN, END};

#[test]
fn every_benchmark_runs_against_every_peer() {
    let dir = tempfile::tempdir().unwrap();
    let (json, markdown) = (dir.path().join("bench.json"), dir.path().join("bench.md"));
    std::fs::write(&markdown, "# Benchmarks\n\nText kept as it is.\n").unwrap();
    // The driver needs the siteboot binary the other lab tests use (it checks it is fresh).
    siteboot_tests::appliance::binary().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .arg("--smoke")
        .arg("--json")
        .arg(&json)
        .arg("--markdown")
        .arg(&markdown)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench --smoke failed ({}):\n{stderr}", out.status);

    let doc = std::fs::read_to_string(&markdown).unwrap();
    assert!(doc.starts_with("# Benchmarks\n\nText kept as it is.\n"), "{doc}");
    let tables = &doc[doc.find(BEGIN).expect("begin marker")..doc.find(END).expect("end marker")];
    for heading in ["### HTTP", "### TFTP", "### DHCP", "### Controller", "### Imaging"] {
        assert!(tables.contains(heading), "no {heading} table:\n{tables}");
    }
    // Each table has a row for every server it compares.
    let tftp_servers = ["siteboot", "tftpd-hpa", "dnsmasq"];
    for (heading, servers) in [
        ("### HTTP: 200 iPXE-script requests", &["siteboot", "nginx"][..]),
        ("### TFTP: a ", &tftp_servers),
        ("### TFTP: 10 clients at once", &tftp_servers),
        ("### DHCP", &["siteboot", "kea", "dnsmasq"]),
    ] {
        let table = section(tables, heading);
        for server in servers {
            assert!(table.contains(&format!("| {server} |")), "no {server} in {heading}:\n{table}");
        }
    }
    // Every server has a row, with a number in its first measured column.
    for server in ["siteboot", "nginx", "tftpd-hpa", "kea", "dnsmasq"] {
        let rows: Vec<&str> =
            tables.lines().filter(|l| l.contains(&format!("| {server} |"))).collect();
        assert!(!rows.is_empty(), "no row for {server}:\n{tables}");
        for row in rows {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let measured = cells.iter().skip_while(|c| **c != server).nth(1).unwrap();
            let number = measured.split_whitespace().next().unwrap_or("");
            assert!(number.parse::<f64>().is_ok(), "{server}: no number in {row:?}");
        }
    }
    // The controller's row (3 hosts) and imaging's (1 and 2 hosts at once): a number in every
    // column.
    for (heading, hosts) in [("### Controller", "3"), ("### Imaging", "1"), ("### Imaging", "2")] {
        let table = section(tables, heading);
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("| {hosts} |")))
            .unwrap_or_else(|| panic!("no row for {hosts} hosts:\n{table}"));
        for cell in row.split('|').map(str::trim).filter(|c| !c.is_empty()) {
            let number = cell.split_whitespace().next().unwrap_or("");
            assert!(number.parse::<f64>().is_ok(), "{heading}: no number in {row:?}");
        }
    }

    let results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for benchmark in
        ["http", "http_requests", "tftp", "dhcp", "tftp_concurrent", "controller", "imaging"]
    {
        assert!(
            results[benchmark].as_array().is_some_and(|a| !a.is_empty()),
            "no {benchmark} samples in the JSON"
        );
    }
    // Every Host went to one Machine and every Machine got one Host.
    assert_eq!(results["controller"][0]["double_claims"], 0, "{}", results["controller"]);
    assert!(results["cpus"].as_u64().unwrap() >= 1);
    assert!(!results["kernel"].as_str().unwrap().is_empty());
}

/// The table under `heading` (a prefix of its heading line): up to the next heading.
fn section<'a>(tables: &'a str, heading: &str) -> &'a str {
    let start = tables.find(heading).unwrap_or_else(|| panic!("no {heading} table:\n{tables}"));
    let rest = &tables[start + heading.len()..];
    &tables[start..start + heading.len() + rest.find("\n### ").unwrap_or(rest.len())]
}
