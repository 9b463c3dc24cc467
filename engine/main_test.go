package engine_test

import (
	"testing"

	"github.com/idemsaga/idemsaga/internal/fixture"
	"github.com/idemsaga/idemsaga/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m, fixture.Migrate) }
