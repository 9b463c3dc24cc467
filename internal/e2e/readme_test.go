package e2e_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestReadmeSagaCompiles compiles the README's saga and main, as a user
// copies them, in place of the example module's own two files: a README
// whose example does not build is the first thing a user meets.
func TestReadmeSagaCompiles(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	section := string(readme)
	start := strings.Index(section, "## Your own saga")
	require.GreaterOrEqual(t, start, 0, "the README's section \"Your own saga\"")
	section = section[start:]
	if end := strings.Index(section[1:], "\n## "); end >= 0 {
		section = section[:end+1]
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(section, -1)
	require.Len(t, blocks, 2, "the section's two Go files: the saga, then main")
	require.Contains(t, blocks[0][1], "package orders")
	require.Contains(t, blocks[1][1], "package main")

	dir := t.TempDir()
	shop, err := filepath.Abs("testdata/shop")
	require.NoError(t, err)
	replace := map[string]string{}
	for i, target := range []string{"orders/orders.go", "cmd/shop/main.go"} {
		file := filepath.Join(dir, filepath.Base(target))
		require.NoError(t, os.WriteFile(file, []byte(blocks[i][1]), 0o600))
		replace[filepath.Join(shop, target)] = file
	}
	overlay, err := json.Marshal(map[string]any{"Replace": replace})
	require.NoError(t, err)
	overlayFile := filepath.Join(dir, "overlay.json")
	require.NoError(t, os.WriteFile(overlayFile, overlay, 0o600))

	cmd := exec.Command("go", "vet", "-overlay", overlayFile, "./orders", "./cmd/shop")
	cmd.Dir = shop
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "the README's example does not compile:\n%s", out)
}
