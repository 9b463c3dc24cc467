// Command shopadmin is an admin tool without the sagas' code: it starts,
// shows and repairs them from the definitions the deployment recorded.
package main

import "github.com/idemsaga/idemsaga/service"

func main() { service.Main(service.Config{Name: "shopadmin"}) }
