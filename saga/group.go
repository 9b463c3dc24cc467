package saga

import "fmt"

// Group returns the indexes [first, end) of the steps that run with step
// i: its parallel group (Step.Group), or i alone.
func (d *Definition) Group(i int) (first, end int) {
	g := d.steps[i].Group
	first, end = i, i+1
	if g == "" {
		return first, end
	}
	for first > 0 && d.steps[first-1].Group == g {
		first--
	}
	for end < len(d.steps) && d.steps[end].Group == g {
		end++
	}
	return first, end
}

// HasGroups reports whether any of the definition's steps is a branch of
// a parallel group.
func (d *Definition) HasGroups() bool { return d.grouped }

// skippable reports whether the steps that run with step i may all be
// skipped by their conditions, so a move may pass their state.
func (d *Definition) skippable(i int) bool {
	first, end := d.Group(i)
	for k := first; k < end; k++ {
		if d.steps[k].When.IsZero() {
			return false
		}
	}
	return true
}

// checkGroups reports what is wrong with the definition's groups, and the
// field: a group's branches are consecutive and reach one state.
func checkGroups(steps []Step) (problem, field string) {
	ended := map[string]bool{}
	for i, s := range steps {
		if s.Group == "" {
			continue
		}
		field = fmt.Sprintf("steps[%d].Group", i)
		if !namePattern.MatchString(s.Group) {
			return fmt.Sprintf("%q must be 1 to 64 letters, digits, '_' or '-'", s.Group), field
		}
		continuing := i > 0 && steps[i-1].Group == s.Group
		if !continuing && ended[s.Group] {
			return fmt.Sprintf("step %q is in group %q, whose branches come before another step; a group's branches are consecutive steps", s.Name, s.Group), field
		}
		ended[s.Group] = true
		if continuing && steps[i-1].Reaches != s.Reaches {
			return fmt.Sprintf("branches %q and %q of group %q reach different states (%q, %q); a group's branches all name the state the saga reaches when every branch succeeded", steps[i-1].Name, s.Name, s.Group, steps[i-1].Reaches, s.Reaches), fmt.Sprintf("steps[%d].Reaches", i)
		}
	}
	return "", ""
}
