//go:build tools

// Package tools pins the programs the Rust test harness runs as real peers: kube-apiserver,
// kube-controller-manager, kube-scheduler, the kubelet, kubeadm and etcd (built from their Go
// modules), the upstream Cluster API managers and clusterctl. Nothing here is compiled into
// siteboot; scripts/build-test-peers builds each program with
// `go build -o <cache>/bin/<name> <package>`, and the blank imports keep `go mod tidy` from
// dropping the modules that provide them.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubeadm"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "sigs.k8s.io/cluster-api/bootstrap/kubeadm"
	_ "sigs.k8s.io/cluster-api/cmd/clusterctl"
	_ "sigs.k8s.io/cluster-api/controlplane/kubeadm"
	_ "sigs.k8s.io/cluster-api/core"
)
