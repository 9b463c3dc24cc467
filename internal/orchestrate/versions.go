package orchestrate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/idemsaga/idemsaga/internal/store"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/saga"
)

// defKey names one version of a definition.
type defKey struct {
	name    string
	version int
}

func keyOf(d *saga.Definition) defKey { return defKey{d.Name(), d.Version()} }

// newestTTL is how long a process without a definition's code trusts the
// newest version it read from the deployment's record.
const newestTTL = HeartbeatInterval

// HeartbeatInterval is how often an engine records that it runs its
// definitions' versions (engine.HeartbeatIntervalDefault).
const HeartbeatInterval = 5 * time.Second

// described caches the definitions a process knows only by their
// recorded descriptions: each version (immutable once recorded), and the
// newest of each name for newestTTL.
type described struct {
	mu     sync.RWMutex
	defs   map[defKey]*saga.Definition
	newest map[string]newestEntry
}

type newestEntry struct {
	def *saga.Definition
	at  time.Time
}

func (d *described) get(k defKey) (*saga.Definition, bool) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	def, ok := d.defs[k]
	return def, ok
}

func (d *described) getNewest(name string) (*saga.Definition, bool) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	e, ok := d.newest[name]
	if !ok || time.Since(e.at) > newestTTL {
		return nil, false
	}
	return e.def, true
}

func (d *described) put(def *saga.Definition, newest bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.defs == nil {
		d.defs, d.newest = map[defKey]*saga.Definition{}, map[string]newestEntry{}
	}
	d.defs[keyOf(def)] = def
	if newest {
		d.newest[def.Name()] = newestEntry{def: def, at: time.Now()}
	}
}

// indexDefinitions returns the newest version of each name, and every
// version by name and version.
func indexDefinitions(defs []*saga.Definition) (map[string]*saga.Definition, map[defKey]*saga.Definition) {
	newest := make(map[string]*saga.Definition, len(defs))
	all := make(map[defKey]*saga.Definition, len(defs))
	for _, d := range defs {
		all[keyOf(d)] = d
		if n, ok := newest[d.Name()]; !ok || d.Version() > n.Version() {
			newest[d.Name()] = d
		}
	}
	return newest, all
}

// definition returns the newest version of the named definition this
// process knows, without a round trip: its own, or one resolve read
// lately. For an existing saga use definitionAt with the saga's version.
func (c *Core) definition(name string) (*saga.Definition, error) {
	if d, ok := c.defs[name]; ok {
		return d, nil
	}
	if d, ok := c.remote.getNewest(name); ok {
		return d, nil
	}
	return nil, fmt.Errorf("%w: %q", saga.ErrUnknownDefinition, name)
}

// local returns a version of a definition this process has the code of.
func (c *Core) local(name string, version int) (*saga.Definition, bool) {
	d, ok := c.versions[defKey{name, max(version, 1)}]
	return d, ok
}

// definitionAt returns the given version of the named definition, the one
// an existing saga runs: this process's own, or one rebuilt from the
// deployment's record (without handlers), which is enough to plan the
// saga's moves, repairs and takeovers.
func (c *Core) DefinitionAt(ctx context.Context, name string, version int) (*saga.Definition, error) {
	version = max(version, 1)
	if d, ok := c.local(name, version); ok {
		return d, nil
	}
	if d, ok := c.remote.get(defKey{name, version}); ok {
		return d, nil
	}
	var desc saga.Description
	err := c.DB().QueryRow(ctx, `select description from idemsaga.definitions where name = $1 and version = $2`, name, version).Scan(&desc)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: %s is neither in this process nor recorded by the deployment (a worker running it records it at start)", saga.ErrUnknownDefinition, saga.Ref(name, version))
	}
	if err != nil {
		return nil, fmt.Errorf("idemsaga: read definition %s: %w", saga.Ref(name, version), err)
	}
	def, err := saga.FromDescription(desc)
	if err != nil {
		return nil, err
	}
	c.remote.put(def, false)
	return def, nil
}

// stepAt returns the given version of a definition and the index of its
// named step.
func (c *Core) stepAt(ctx context.Context, definition string, version int, step string) (*saga.Definition, int, error) {
	def, err := c.DefinitionAt(ctx, definition, version)
	if err != nil {
		return nil, 0, err
	}
	idx := def.StepIndex(step)
	if idx < 0 {
		return nil, 0, fmt.Errorf("definition %s has no step %q; deploy the same definition everywhere", def.Ref(), step)
	}
	return def, idx, nil
}

// resolve returns the newest version of the named definition: this
// process's own, or, for a definition whose code is not here, the newest
// recorded version a live worker runs (else the newest recorded), rebuilt
// from its description (without handlers).
func (c *Core) Resolve(ctx context.Context, name string) (*saga.Definition, error) {
	if d, err := c.definition(name); err == nil {
		return d, nil
	}
	var desc saga.Description
	err := c.DB().QueryRow(ctx, store.NewestRecorded, name, (3 * HeartbeatInterval).Milliseconds()).Scan(&desc)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: %q is neither in this process nor recorded by the deployment (a worker running it records it at start)", saga.ErrUnknownDefinition, name)
	}
	if err != nil {
		return nil, fmt.Errorf("idemsaga: read definition %q: %w", name, err)
	}
	def, err := saga.FromDescription(desc)
	if err != nil {
		return nil, err
	}
	c.remote.put(def, true)
	return def, nil
}

// versionRefs returns "name@version" of every definition this process
// runs.
func (c *Core) VersionRefs() []string { return c.refs }

func refsOf(versions map[defKey]*saga.Definition) []string {
	refs := make([]string, 0, len(versions))
	for _, d := range versions {
		refs = append(refs, d.Ref())
	}
	slices.Sort(refs)
	return refs
}
