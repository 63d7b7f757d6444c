package egress

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// roots is a pool of the web host's CA.
func mustSecret(t *testing.T, spec string) Secret {
	t.Helper()
	s, err := ParseSecret(spec)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSecretsAtTheEgress: the box holds placeholders; the secret's host
// receives the values, over HTTPS only, transparently and through the
// proxy; no other host ever does (sent the placeholder directly, or after
// a redirect); an echo of the value comes back to the box as the
// placeholder; rewriting the secret's file takes effect at once; and no
// log line holds a value.
func TestSecretsAtTheEgress(t *testing.T) {
	const tokenV1, tokenV2, keyV = "tok-6e8c1f-first", "tok-91ab77-second", "key-3d2f5a-env"
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(tokenV1+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KILN_TEST_EGRESS_KEY", keyV)
	w := newWorld(t, func(o *Options) {
		o.Secrets = []Secret{
			mustSecret(t, "API_TOKEN@api.test=file:"+tokenFile),
			mustSecret(t, "API_KEY@API.test=env:KILN_TEST_EGRESS_KEY"),
			mustSecret(t, "ELSEWHERE@elsewhere.test=env:KILN_TEST_EGRESS_KEY"),
		}
	})
	b := w.newBox(t, "s-secret", "api.test", "web.test")
	values := []string{tokenV1, tokenV2, keyV}

	// The box's environment: placeholders for the hosts it may reach.
	env := b.att.Env()
	var tok, key string
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "API_TOKEN":
			tok = v
		case "API_KEY":
			key = v
		case "ELSEWHERE":
			t.Errorf("the box got a placeholder for a host its policy does not allow: %s", kv)
		}
		for _, val := range values {
			if strings.Contains(v, val) {
				t.Errorf("the box's environment holds a secret: %s", k)
			}
		}
	}
	if tok == "" || key == "" {
		t.Fatalf("no placeholders in the box's environment: %q", env)
	}
	bundle := filepath.Join(t.TempDir(), "bundle.pem")
	if err := os.WriteFile(bundle, b.att.TrustBundle(), 0o644); err != nil {
		t.Fatal(err)
	}
	trust := append(TrustEnv(bundle), "API_TOKEN="+tok, "API_KEY="+key)
	proxied := append(slices.Clone(trust), "HTTPS_PROXY=http://"+w.gw.GatewayAddr().String()+":3128")
	run := func(env []string, args ...string) string {
		t.Helper()
		out, _ := b.exec(t, env, "sh", append([]string{"-c", `curl -sS -i --max-time 20 --cacert "$SSL_CERT_FILE" -H "Authorization: Bearer $API_TOKEN" -H "X-Api-Key: $API_KEY" "$@"`, "curl"}, args...)...)
		for _, val := range values {
			if strings.Contains(out, val) {
				t.Errorf("curl %q: the box received a secret's value", args)
			}
		}
		return out
	}
	want := "api.test auth=Bearer " + tokenV1 + " key=" + keyV
	for _, tc := range []struct {
		name string
		env  []string
	}{{"transparent", trust}, {"proxy", proxied}} {
		t.Run(tc.name, func(t *testing.T) {
			out := run(tc.env, "https://api.test/echo")
			if got := w.Served(); !slices.Equal(got, []string{want}) {
				t.Errorf("api.test received %q, want %q", got, want)
			}
			// The server echoed the value in a header and the body; the
			// box sees the placeholders there.
			wantContains(t, out, "X-Echo: api.test auth=Bearer "+tok+" key="+key)
			wantContains(t, out, "echo api.test auth=Bearer "+tok+" key="+key)
		})
	}

	// Plain HTTP to the secret's host never carries the value.
	run(trust, "http://api.test/echo")
	if got := w.Served(); !slices.Equal(got, []string{"api.test auth=Bearer " + tok + " key=" + key}) {
		t.Errorf("plain HTTP to api.test: it received %q, want the placeholders", got)
	}
	// The same placeholders sent to another allowed host stay placeholders
	// (its TLS is not intercepted: the box checks web.test's own
	// certificate), and so does a redirect from the secret's host to it.
	webTrust := append(slices.Clone(trust), "SSL_CERT_FILE="+w.CAFile)
	run(webTrust, "https://web.test/echo")
	run(trust, "-L", "--cacert", bundle, "--proxy-cacert", bundle, "https://api.test/redirect?to=http://web.test/echo")
	for _, got := range w.Served() {
		if strings.HasPrefix(got, "web.test") && (strings.Contains(got, tokenV1) || strings.Contains(got, keyV)) {
			t.Errorf("web.test received a secret: %q", got)
		}
	}

	// A new value in the file applies to the next request.
	if err := os.WriteFile(tokenFile, []byte(tokenV2+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	run(trust, "https://api.test/echo")
	if got, want := w.Served(), "api.test auth=Bearer "+tokenV2+" key="+keyV; !slices.Equal(got, []string{want}) {
		t.Errorf("after the rotation api.test received %q, want %q", got, want)
	}

	logs := w.logs.String()
	for _, val := range values {
		if strings.Contains(logs, val) {
			t.Errorf("the gateway's log holds a secret's value")
		}
	}
}

func TestParseSecret(t *testing.T) {
	t.Setenv("KILN_TEST_EGRESS_SET", "v")
	for _, bad := range []string{
		"", "TOKEN", "TOKEN@api.test", "token@api.test=env:KILN_TEST_EGRESS_SET", "TOKEN@*.api.test=env:KILN_TEST_EGRESS_SET",
		"TOKEN@api.test=env:KILN_TEST_EGRESS_UNSET", "TOKEN@api.test=file:/nonexistent/kiln", "TOKEN@api.test=vault:x", "TOKEN@=env:KILN_TEST_EGRESS_SET",
	} {
		if _, err := ParseSecret(bad); err == nil {
			t.Errorf("ParseSecret(%q) = nil error", bad)
		}
	}
	// A secret file others may read is refused, as kiln's other secret
	// files are.
	open := filepath.Join(t.TempDir(), "token")
	os.WriteFile(open, []byte("v\n"), 0o644)
	if _, err := ParseSecret("TOKEN@api.test=file:" + open); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("a group-readable secret file: %v, want a refusal that says chmod 600", err)
	}
	s, err := ParseSecret("TOKEN@API.Test.=env:KILN_TEST_EGRESS_SET")
	if err != nil || s.Host != "api.test" || s.Name != "TOKEN" {
		t.Errorf("ParseSecret: %+v %v", s, err)
	}
}
