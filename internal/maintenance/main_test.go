package maintenance

import (
	"testing"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }
