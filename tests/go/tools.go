//go:build tools

// Package tools pins the programs the Rust test harness runs as real peers: kube-apiserver and
// etcd (built from their Go modules) and the upstream Cluster API managers. Nothing here is
// compiled into siteboot; scripts/build-test-peers builds each program with
// `go build -o <cache>/bin/<name> <package>`, and the blank imports keep `go mod tidy` from
// dropping the modules that provide them.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "sigs.k8s.io/cluster-api/bootstrap/kubeadm"
	_ "sigs.k8s.io/cluster-api/core"
)
