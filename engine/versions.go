package engine

import (
	"context"

	"github.com/idemsaga/idemsaga/saga"
)

// DefinitionAt returns the given version of the named definition: this
// client's own, or one rebuilt from the description the deployment
// recorded. A saga runs the version in its DefinitionVersion. An unknown
// name or version is saga.ErrUnknownDefinition.
func (cl *Client) DefinitionAt(ctx context.Context, name string, version int) (*saga.Definition, error) {
	return cl.c.DefinitionAt(ctx, name, version)
}
