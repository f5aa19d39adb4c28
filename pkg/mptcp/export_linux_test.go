package mptcp

// GetSubflowsLegacy exports the pre-6.5 reading of the subflows to the
// external tests.
var GetSubflowsLegacy = getSubflowsLegacy
