// Copyright 2026 The mpnbd Authors.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

// Package driver implements the CSI Identity, Controller and Node services.
package driver

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/datapath"
)

// Sentinel errors of the driver. Lower layers wrap them (or their own
// sentinels, mapped below); toStatus turns them into gRPC codes in this
// one place, so no handler returns Unknown by accident.
var (
	ErrInvalidArgument  = errors.New("invalid argument")
	ErrNotFound         = errors.New("not found")
	ErrAlreadyExists    = errors.New("already exists")
	ErrExhausted        = errors.New("resource exhausted")
	ErrPrecondition     = errors.New("failed precondition")
	ErrAborted          = errors.New("operation in progress")
	ErrOutOfRange       = errors.New("out of range")
	ErrUnavailable      = errors.New("unavailable")
	ErrUnimplementedErr = errors.New("unimplemented")
)

// toStatus maps an error to a gRPC status error. Errors that already are
// status errors pass through.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	code := codes.Internal
	switch {
	case errors.Is(err, ErrInvalidArgument), errors.Is(err, attach.ErrInvalid):
		code = codes.InvalidArgument
	case errors.Is(err, ErrNotFound), errors.Is(err, attach.ErrNotAttached):
		code = codes.NotFound
	case errors.Is(err, ErrAlreadyExists):
		code = codes.AlreadyExists
	case errors.Is(err, ErrExhausted):
		code = codes.ResourceExhausted
	case errors.Is(err, ErrPrecondition), errors.Is(err, attach.ErrWrongVolume), errors.Is(err, attach.ErrServerRefused):
		code = codes.FailedPrecondition
	case errors.Is(err, ErrAborted):
		code = codes.Aborted
	case errors.Is(err, ErrOutOfRange):
		code = codes.OutOfRange
	case errors.Is(err, ErrUnavailable), errors.Is(err, attach.ErrUnsupported), errors.Is(err, attach.ErrTooSmall),
		errors.Is(err, datapath.ErrUnavailable), errors.Is(err, attach.ErrUnflushed):
		code = codes.Unavailable
	case errors.Is(err, ErrUnimplementedErr):
		code = codes.Unimplemented
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	}
	return status.Error(code, err.Error())
}
