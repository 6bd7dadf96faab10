// Command extender_pools replays kube-scheduler's calls to one extender server the way
// kube-scheduler makes them, to show what sharing one connection pool between filter and bind
// costs: one goroutine calls filter one pod at a time (the serial scheduling cycle), and after
// each filter a bind starts in its own goroutine (the asynchronous binding cycle), answered
// slowly by the server. Each mode uses net/http.Transport as kube-scheduler's makeTransport
// builds it (pkg/scheduler/extender.go, v1.36.3: a Transport per extender entry, Go's default
// of two idle connections per host), HTTP/1.1 as against the operator's server.
//
//	shared: one extender entry (filter and bind on one Transport)
//	split:  two entries (filter and prioritize, then bind), one Transport each
//
// It prints, per mode, how many filter calls had to open a new TLS connection and their
// latency percentiles. Usage: extender_pools URL CA_FILE PODS shared|split
package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"
)

func transport(pool *x509.CertPool) *http.Transport {
	return &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "localhost"},
		// the operator's server speaks HTTP/1.1 only: no HTTP/2 upgrade to attempt
		TLSNextProto: map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
}

func post(c *http.Client, url string, body []byte, trace *httptrace.ClientTrace) error {
	req, err := http.NewRequest("POST", url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	if trace != nil {
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), trace))
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return err
}

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: extender_pools URL CA_FILE PODS shared|split")
		os.Exit(2)
	}
	url, caFile, mode := os.Args[1], os.Args[2], os.Args[4]
	pods, err := strconv.Atoi(os.Args[3])
	if err != nil || (mode != "shared" && mode != "split") {
		fmt.Fprintln(os.Stderr, "PODS is a number, the mode shared or split")
		os.Exit(2)
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		panic(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	filterTr := transport(pool)
	bindTr := filterTr
	if mode == "split" {
		bindTr = transport(pool)
	}
	filterC, bindC := &http.Client{Transport: filterTr}, &http.Client{Transport: bindTr}
	body := bytes.Repeat([]byte("x"), 2500) // about a pod and 100 node names
	dialed := 0
	var ms []float64
	var binds sync.WaitGroup
	for i := 0; i < pods; i++ {
		reused := true
		trace := &httptrace.ClientTrace{GotConn: func(ci httptrace.GotConnInfo) { reused = ci.Reused }}
		t0 := time.Now()
		if err := post(filterC, url+"/filter", body, trace); err != nil {
			panic(err)
		}
		ms = append(ms, float64(time.Since(t0).Microseconds())/1000)
		if !reused {
			dialed++
		}
		binds.Add(1)
		go func() {
			defer binds.Done()
			_ = post(bindC, url+"/bind", body, nil)
		}()
		time.Sleep(2 * time.Millisecond) // the rest of a scheduling cycle
	}
	binds.Wait()
	sort.Float64s(ms)
	q := func(p float64) float64 { return ms[int(p*float64(len(ms)-1))] }
	fmt.Printf("%s: %d filter calls, %d opened a new connection; filter latency p50 %.2f ms, p90 %.2f ms, p99 %.2f ms\n",
		mode, pods, dialed, q(0.5), q(0.9), q(0.99))
}
