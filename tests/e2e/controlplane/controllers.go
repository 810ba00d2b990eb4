package main

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/controller-manager/pkg/informerfactory"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/controller/garbagecollector"
	"k8s.io/kubernetes/pkg/controller/namespace"
	"k8s.io/kubernetes/pkg/controller/serviceaccount"
)

// How often the garbage collector asks discovery for new resource types. The
// controller-manager waits 30 s; tests create CRDs and at once expect owned
// objects to be collected, so a short period matters more than a few cheap
// discovery calls against a local apiserver.
const garbageCollectorResync = 2 * time.Second

// startControllers runs, in this process, the three kube-controller-manager
// controllers whose absence tests would notice even without nodes: namespace
// (deleting a namespace empties it and then removes it; without it deletion
// hangs in Terminating), garbage collector (ownerReferences cascade), and
// service account (each namespace gets "default", which the ServiceAccount
// admission plugin requires of every pod). They stop when ctx ends.
func startControllers(ctx context.Context, adminConfig *rest.Config) error {
	config := rest.CopyConfig(adminConfig)
	// client-go's default 5 requests/s would make emptying a namespace crawl.
	config.QPS, config.Burst = 200, 400
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return err
	}
	metadataClient, err := metadata.NewForConfig(config)
	if err != nil {
		return err
	}
	// The garbage collector wants its own discovery client for resyncs, apart
	// from the cached one behind its REST mapper.
	gcDiscovery, err := discovery.NewDiscoveryClientForConfig(config)
	if err != nil {
		return err
	}

	typedInformers := informers.NewSharedInformerFactory(client, 0)
	metadataInformers := metadatainformer.NewSharedInformerFactory(metadataClient, 0)
	informersStarted := make(chan struct{})

	namespaces := namespace.NewNamespaceController(ctx, client, metadataClient,
		client.Discovery().ServerPreferredNamespacedResources,
		typedInformers.Core().V1().Namespaces(), 5*time.Minute, corev1.FinalizerKubernetes)
	serviceAccounts, err := serviceaccount.NewServiceAccountsController(klog.FromContext(ctx),
		typedInformers.Core().V1().ServiceAccounts(), typedInformers.Core().V1().Namespaces(),
		client, serviceaccount.DefaultServiceAccountsControllerOptions())
	if err != nil {
		return err
	}
	restMapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(client.Discovery()))
	garbageCollector, err := garbagecollector.NewGarbageCollector(ctx, client, metadataClient, restMapper,
		garbagecollector.DefaultIgnoredResources(),
		informerfactory.NewInformerFactory(typedInformers, metadataInformers), informersStarted)
	if err != nil {
		return err
	}

	typedInformers.Start(ctx.Done())
	metadataInformers.Start(ctx.Done())
	close(informersStarted)
	go namespaces.Run(ctx, 2)
	go serviceAccounts.Run(ctx, 1)
	go garbageCollector.Run(ctx, 2, 30*time.Second)
	go garbageCollector.Sync(ctx, gcDiscovery, garbageCollectorResync)
	return nil
}
