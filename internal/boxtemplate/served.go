package boxtemplate

import "slices"

// LoadServed is Load for a server on backend server that also serves
// templates made on the backends in made: a template's files are plain
// files, so the microVM serves templates made on the jail. A template
// from another kiln, or made on any other backend, is refused.
func (s *Store) LoadServed(name, kilnVersion, server string, made []string) (*Template, error) {
	t, err := s.read(name)
	if err != nil {
		return nil, err
	}
	if t.Backend == server || !slices.Contains(made, t.Backend) {
		return s.Load(name, kilnVersion, server)
	}
	return s.Load(name, kilnVersion, t.Backend)
}
