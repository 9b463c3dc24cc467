package service_test

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"os"

	"github.com/idemsaga/idemsaga/internal/exampleenv"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

//go:embed testdata/migrations/*.sql
var migrations embed.FS

// A service's main: its definitions and its tables give its binary every
// command (run, migrate, start, list, show, retry, cancel, reconcile,
// workers). Here the command lines run in the example; in a real main,
// service.Main(cfg) reads os.Args.
func Example() {
	infra := exampleenv.New()
	defer infra.Close()
	defer setenv("DATABASE_URL", infra.URL)()
	defer setenv("NATS_URL", infra.NATSURL)()

	greet := saga.MustNew("greet", saga.Step{Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
		Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, in struct {
			Name string `json:"name"`
		}) (struct{}, error) {
			_, err := sc.Tx.Exec(ctx, `insert into greetings.sent (key, name) values ($1, $2)`, sc.Key, in.Name)
			return struct{}{}, err
		})})
	files, _ := fs.Sub(migrations, "testdata") // its migrations folder
	cfg := service.Config{
		Name:        "greeter",
		Definitions: []*saga.Definition{greet},
		Migrations:  []service.Migration{{Schema: "greetings", Files: files}},
	}
	// func main() { service.Main(cfg) }
	ctx := context.Background()
	if err := service.Run(ctx, cfg, []string{"migrate"}); err != nil {
		fmt.Println(err)
	}
	if err := service.Run(ctx, cfg, []string{"workers"}); err != nil {
		fmt.Println(err)
	}
	// Output:
	// engine schema idemsaga at version 8
	// schema greetings at version 1
	// deployment: stream IDEMSAGA, subject prefix idemsaga, lease grace 30s; definitions greet
	// HOST  PID  STARTED  DEFINITIONS
	// 0 live workers
}

// setenv sets an environment variable for the example and returns what
// puts it back.
func setenv(k, v string) func() {
	old, had := os.LookupEnv(k)
	os.Setenv(k, v)
	return func() {
		if had {
			os.Setenv(k, old)
		} else {
			os.Unsetenv(k)
		}
	}
}
