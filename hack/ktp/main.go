// Command ktp ("kube test plane"): one multi-call binary holding etcd and the
// Kubernetes control-plane components, built from the k8s.io/kubernetes Go modules.
// One component per process; the command is constructed lazily so the process-global
// feature-gate registries of the components never meet.
//
//	ktp etcd|kube-apiserver|kube-scheduler|kube-controller-manager|kubectl|kubelet [flags]
//
// or invoked through a symlink named after the component.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	_ "time/tzdata"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	kcm "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	name, args := filepath.Base(os.Args[0]), os.Args[1:]
	if name == "ktp" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, "usage: ktp etcd|kube-apiserver|kube-scheduler|kube-controller-manager|kubectl|kubelet [flags]")
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	var cmd *cobra.Command
	switch name {
	case "etcd":
		etcdmain.Main(append([]string{"etcd"}, args...))
		return
	case "kube-apiserver":
		cmd = apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		cmd = kcm.NewControllerManagerCommand()
	case "kube-scheduler":
		cmd = scheduler.NewSchedulerCommand()
	case "kubelet":
		cmd = kubelet.NewKubeletCommand(context.Background())
	case "kubectl":
		kc := kubectl.NewDefaultKubectlCommand()
		kc.SetArgs(args)
		if err := cli.RunNoErrOutput(kc); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	default:
		fmt.Fprintf(os.Stderr, "ktp: unknown component %q\n", name)
		os.Exit(2)
	}
	cmd.SetArgs(args)
	os.Exit(cli.Run(cmd))
}
